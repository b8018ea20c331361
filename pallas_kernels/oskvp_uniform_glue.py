"""The prologue and epilogue of the wired Mosaic GPU OS-KVP path (`kv_cache="oskvp_uniform"`) as two small Pallas
(Triton) kernels: `uniform_decode_attention(glue="pallas")`, five GPU kernels per call in all.

`moe_jax/kv_quant/oskvp_uniform_codes.uniform_decode_attention` (glue="xla") wraps the fused core
(`oskvp_decode_core_mgpu.py`) in about eighteen small XLA kernels: the query rotation and digits, pads, the merge
of the splits, the residual window's attention, the log-sum-exp merge and the rotation back. The GPU runs them back
to back, but each costs a µs or two, and at batch 1 they are most of the call (results/decode_timeline.md). Here the
two rotations stay XLA matmuls and everything between them and the core is two kernels:

prologue (one program per row b, kv head k; q' = q U_k the rotated query [G, H] (XLA), c = log2(e) / √H,
cb_k = c0 + d·code):
  qd int8 [8, H]    round(q'·d / u) per head, u = max_ch |q'·d| / 127 (rows G.. zero): the core's query digits
  qs f32 [32]       u·c in [0, G), the row's compressed length n_comp at index 8 (the core's `qs_row`)
  qo f16 [8, 16]    q'[:, :8]·scale_k·c (the key-outlier query; columns 8.. zero)
  qc f32 [8]        c·Σ q'·c0 (the score part the codes do not carry)
epilogue (one program per row, kv head and HC output channels; the core's per-split outputs acc [splits, H, 8]
(channel order), ml [splits, 32] (m, l), acco [splits, 8, 8]):
  the splits merged by log-sum-exp, o' = c0_v + d_v·mean code (+ the value outliers · scale_v on channels 0..7),
  exact attention over the window (res_k, res_v [R, H], n_res tokens; the dots as bf16 hi + lo parts, f32 sums),
  the two merged by log-sum-exp: o' [16, H] in the rotated basis (rows G.. meaningless); U_vᵀ follows in XLA.
The references are the jnp functions they replace (`prologue_reference`, `epilogue_reference`).

History: the first form of these kernels (ninth session) also did both rotations, one program per row and kv head,
and was slower than the XLA glue on the H200 (prologue 14 µs, epilogue 60 µs at 64k × 8 against 35 µs for all the
XLA glue, results/oskvp_uniform_profile_pallas_glue.md): each program ran long chains of dependent loads and f32
dots. This form has B·K·H/HC epilogue programs, one round of loads each, and tensor-core window dots.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.oskvp_decode_core_mgpu import MASKED, N, OUTLIERS, P_LEVELS, merge_splits
from pallas_kernels.oskvp_decode_prologue import _round, unfold_rows

LOG2E = 1.0 / math.log(2.0)
ROWS = 16  # the rotated query's rows in the epilogue (tl.dot needs 16)
QS_SLOTS = 32  # the core's qs row: 8 scales, the length at index 8, padding to the 128 bytes a TMA copy moves
LEN_SLOT = N


# ---- The jnp glue (XLA): the default around the core (`oskvp_uniform_codes.uniform_decode_attention`), and the
# pieces the kernels' references are built from.

def uniform_steps(cb: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cb f32 [..., H, 4] uniform codebooks -> (c0 [..., H], d [..., H]), cb[c] = c0 + d·c."""
  return cb[..., 0], cb[..., 1] - cb[..., 0]


def query_digits(q_rot: jax.Array, cb_k: jax.Array, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q_rot f32 [BK, G, H], cb_k [BK, H, 4] -> (qd int8 [BK, 8, H], qs f32 [BK, 8], const f32 [BK, G]).

  qd = round(q'·d_k / u), u = max_ch |q'·d_k| / 127 per head (rows G.. zero); qs = u · scale · log2(e) turns the
  integer scores into base-2 logits; const = scale · log2(e) · q'·c0_k, the score part the codes do not carry.
  """
  bk, g, _ = q_rot.shape
  if g > N:
    raise ValueError(f"q_rot has G={g} query heads per kv head; the kernel takes at most {N}")
  c0, d = uniform_steps(cb_k.astype(jnp.float32))
  qf = q_rot.astype(jnp.float32) * d[:, None, :]  # [BK, G, H]
  u = jnp.maximum(jnp.max(jnp.abs(qf), axis=-1), 1e-30) / 127.0  # [BK, G]
  qd = jnp.round(qf / u[..., None]).astype(jnp.int8)
  pad = ((0, 0), (0, N - g))
  qd = jnp.pad(qd, (*pad, (0, 0)))
  qs = jnp.pad(u * (scale * LOG2E), pad)
  const = jnp.einsum("bgh,bh->bg", q_rot.astype(jnp.float32), c0) * (scale * LOG2E)
  return qd, qs, const


def outlier_query(q_rot: jax.Array, scale_k: jax.Array, scale: float) -> jax.Array:
  """q_rot f32 [BK, G, H], scale_k f32 [BK, 8] -> qo f16 [BK, 8, 8]: the key-outlier query q'[:, :8]·scale_k in base-2
  logits (rows G.. zero), the core's `qo`."""
  g = q_rot.shape[1]
  qo = q_rot[..., :OUTLIERS].astype(jnp.float32) * scale_k[:, None, :] * (scale * LOG2E)  # [BK, G, 8]
  return jnp.pad(qo, ((0, 0), (0, N - g), (0, 0))).astype(jnp.float16)


def window_attention(q_rot: jax.Array, res_k: jax.Array, res_v: jax.Array, n_res: jax.Array, *,
                     scale: float) -> tuple[jax.Array, jax.Array]:
  """Exact attention over the residual window: q_rot f32 [BK, G, H], res_k, res_v [BK, R, H] (rotated), n_res int32
  [BK] -> (o' f32 [BK, G, H], lse2 f32 [BK, G]) in the form `merge_lse2` takes (-inf and zeros without tokens)."""
  s = jnp.einsum("bgh,brh->bgr", q_rot, res_k.astype(jnp.float32)) * (scale * LOG2E)
  s = jnp.where(jnp.arange(res_k.shape[1])[None, None, :] < n_res[:, None, None], s, -jnp.inf)
  top = jnp.maximum(s.max(axis=-1), MASKED)
  p = jnp.exp2(s - top[..., None])
  total = p.sum(axis=-1)
  o = jnp.einsum("bgr,brh->bgh", p, res_v.astype(jnp.float32)) / jnp.maximum(total, 1e-30)[..., None]
  return o, jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30)), -jnp.inf)


def merge_lse2(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Joins two softmax attentions over disjoint token sets: o [..., H] with their log2-sum-exp2 [...] -> (o, lse2).

  A side with lse2 = -inf (no tokens) has weight 0; both empty gives zeros and -inf.
  """
  top = jnp.maximum(jnp.maximum(lse1, lse2), MASKED)
  w1, w2 = jnp.exp2(lse1 - top), jnp.exp2(lse2 - top)
  total = w1 + w2
  o = (w1[..., None] * o1 + w2[..., None] * o2) / jnp.maximum(total, 1e-30)[..., None]
  return o, jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30)), -jnp.inf)


# ---- References of the two kernels.

def prologue_reference(q_rot, cb_k, scale_k, n_comp):
  """q_rot f32 [B, K, G, H] (rotated), cb_k [B, K, H, 4], scale_k [B, K, 8], n_comp int32 [B] -> (qd int8
  [B, K, 8, H], qs f32 [B, K, 32], qo f16 [B, K, 8, 16], qc f32 [B, K, 8]) (module docstring): the jnp glue's
  `query_digits` and `outlier_query`, laid out as the kernel writes them."""
  b, kh, g, h = q_rot.shape
  rows = q_rot.reshape(b * kh, g, h).astype(jnp.float32)
  qd, qs, qc = query_digits(rows, cb_k.reshape(b * kh, h, 4), h**-0.5)
  qo = outlier_query(rows, scale_k.reshape(b * kh, OUTLIERS), h**-0.5)
  qs = jnp.pad(qs, ((0, 0), (0, QS_SLOTS - N))).at[:, LEN_SLOT].set(jnp.repeat(n_comp, kh).astype(jnp.float32))
  per_head = lambda x: x.reshape(b, kh, *x.shape[1:])
  return (per_head(qd), per_head(qs), per_head(jnp.pad(qo, ((0, 0), (0, 0), (0, OUTLIERS)))),
          per_head(jnp.pad(qc, ((0, 0), (0, N - g)))))


def epilogue_reference(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res):
  """The core's per-split outputs acc [B, K, S, H, 8] (channel order), ml [B, K, S, 32], acco [B, K, S, 8, 8]
  ([outlier channel, head]); q_rot f32 [B, K, G, H]; the prologue's qc [B, K, 8]; cb_v [B, K, H, 4], scale_v
  [B, K, 8], res_k, res_v [B, K, R, H], n_res int32 [B] -> o' f32 [B, K, 16, H] in the rotated basis (rows G..
  meaningless): `merge_splits`, the value codebooks and outliers, `window_attention`, `merge_lse2`."""
  b, kh, _, h, _ = acc.shape
  g = q_rot.shape[2]
  mean, mean_o, lse_c = merge_splits(acc, ml, acco)  # [B, K, 8, H], [B, K, 8, 8], [B, K, 8]
  c0, d = uniform_steps(cb_v)
  o_c = (c0[:, :, None, :] + d[:, :, None, :] * mean).at[..., :OUTLIERS].add(mean_o * scale_v[:, :, None, :])
  rows = lambda x: x.reshape(b * kh, *x.shape[2:])
  with jax.default_matmul_precision("highest"):
    o_r, lse_r = window_attention(rows(q_rot).astype(jnp.float32), rows(res_k), rows(res_v), jnp.repeat(n_res, kh),
                                  scale=h**-0.5)
  pad = ((0, 0), (0, ROWS - g))
  o, _ = merge_lse2(jnp.pad(rows(o_c), ((0, 0), (0, ROWS - N), (0, 0))),
                    jnp.pad(rows(lse_c + qc), ((0, 0), (0, ROWS - N)), constant_values=-jnp.inf),
                    jnp.pad(o_r, (*pad, (0, 0))), jnp.pad(lse_r, pad, constant_values=-jnp.inf))  # [BK, 16, H]
  return o.reshape(b, kh, ROWS, h)


# ---- Kernels.

def _prologue_kernel(q_ref, cb_ref, sk_ref, nc_ref, qd_ref, qs_ref, qo_ref, qc_ref):
  # q_ref [G, H] f32 (rotated); cb_ref [H, 4] f32; sk_ref [8] f32; nc_ref [] int32.
  # qd_ref [8, H] int8; qs_ref [32] f32; qo_ref [8, 16] f16; qc_ref [8] f32.
  g, h = q_ref.shape
  c = h**-0.5 * LOG2E
  q = q_ref[...]
  c0 = cb_ref[:, 0]
  qf = q * (cb_ref[:, 1] - c0)[None, :]  # [G, H]
  u = jnp.maximum(jnp.abs(qf).max(axis=1), 1e-30) / 127.0  # [G]
  qd_ref[...] = unfold_rows([_round(qf / u[:, None])], N, jnp.int8)
  slots = jnp.arange(QS_SLOTS)
  qs = unfold_rows([(u * c)[:, None]], QS_SLOTS, jnp.float32).reshape(QS_SLOTS)
  qs_ref[...] = jnp.where(slots == LEN_SLOT, nc_ref[...].astype(jnp.float32), jnp.where(slots < g, qs, 0.0))
  cols = 2 * OUTLIERS  # the f16 wgmma's K: channels 0..7 and 8 zero columns
  scale = plgpu.load(sk_ref.at[pl.ds(0, cols)], mask=jnp.arange(cols) < OUTLIERS, other=0.0)  # [16]
  qo_ref[...] = unfold_rows([q_ref[:, pl.ds(0, cols)] * (scale[None, :] * c)], N, jnp.float16)
  qc = unfold_rows([((q * c0[None, :]).sum(axis=1) * c)[:, None]], N, jnp.float32).reshape(N)
  qc_ref[...] = jnp.where(jnp.arange(N) < g, qc, 0.0)


def _dot_f32(a, b):
  """a f32 [M, K] @ b bf16 [K, N] on the tensor cores: a as bf16 hi + lo parts (relative error ~2^-16), f32 sums."""
  hi = a.astype(jnp.bfloat16)
  lo = (a - hi.astype(jnp.float32)).astype(jnp.bfloat16)
  return (jnp.dot(hi, b, preferred_element_type=jnp.float32) + jnp.dot(lo, b, preferred_element_type=jnp.float32))


def _epilogue_kernel(acc_ref, ml_ref, ao_ref, q_ref, qc_ref, cb_ref, sv_ref, rk_ref, rv_ref, nr_ref, o_ref):
  # acc_ref [S, HC, 8] f32 (channel order: this program's HC channels); ml_ref [S, 32]; ao_ref [S, 8, 8]
  # ([outlier channel, head]); q_ref [G, H] f32 (rotated); qc_ref [8]; cb_ref [HC, 4]; sv_ref [8];
  # rk_ref [R, H] bf16; rv_ref [R, HC] bf16; nr_ref []. o_ref [16, HC] f32. One round of loads, no loops.
  hc = acc_ref.shape[1]
  h = q_ref.shape[1]
  r = rk_ref.shape[0]
  m, l = ml_ref[:, pl.ds(0, N)], ml_ref[:, pl.ds(N, N)]  # [S, 8]
  top = m.max(axis=0)  # [8]
  w = jnp.exp2(m - top[None, :])  # [S, 8]
  total = (w * l).sum(axis=0)
  inv = 1.0 / jnp.maximum(total, 1e-30)
  mean = ((acc_ref[...] * w[:, None, :]).sum(axis=0) * inv[None, :]).T  # [8, HC]
  mean_o = ((ao_ref[...] * w[:, None, :]).sum(axis=0) * inv[None, :]).T  # [8 heads, 8 outlier channels]
  c0 = cb_ref[:, 0]
  o_c = c0[None, :] + (cb_ref[:, 1] - c0)[None, :] * mean  # [8, HC]
  channel = pl.program_id(2) * hc + jax.lax.broadcasted_iota(jnp.int32, (OUTLIERS, hc), 1)
  onehot = (jax.lax.broadcasted_iota(jnp.int32, (OUTLIERS, hc), 0) == channel).astype(jnp.float32)  # [8, HC]
  o_c += ((mean_o * sv_ref[...][None, :])[:, :, None] * onehot[None]).sum(axis=1)  # channels 0..7
  lse_c = jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30) / P_LEVELS) + qc_ref[...], -jnp.inf)
  # The window: scores over all H channels, values of this program's channels.
  s = _dot_f32(unfold_rows([q_ref[...]], ROWS, jnp.float32), rk_ref[...].T) * (h**-0.5 * LOG2E)  # [16, R]
  live = jax.lax.broadcasted_iota(jnp.int32, (ROWS, r), 1) < nr_ref[...]
  m_r = jnp.where(live, s, MASKED).max(axis=1)
  p = jnp.where(live, jnp.exp2(s - m_r[:, None]), 0.0)
  total_r = p.sum(axis=1)
  o_r = _dot_f32(p, rv_ref[...]) / jnp.maximum(total_r, 1e-30)[:, None]  # [16, HC]
  lse_r = jnp.where(total_r > 0, m_r + jnp.log2(jnp.maximum(total_r, 1e-30)), -jnp.inf)
  o_c16 = unfold_rows([o_c], ROWS, jnp.float32)
  lse_c16 = jnp.where(jnp.arange(ROWS) < N, unfold_rows([lse_c[:, None]], ROWS, jnp.float32).reshape(ROWS), -jnp.inf)
  top2 = jnp.maximum(jnp.maximum(lse_c16, lse_r), MASKED)
  w1, w2 = jnp.exp2(lse_c16 - top2), jnp.exp2(lse_r - top2)
  o_ref[...] = (w1[:, None] * o_c16 + w2[:, None] * o_r) / jnp.maximum(w1 + w2, 1e-30)[:, None]


def _spec(*tail):
  return pl.BlockSpec((None, None, *tail), lambda i, j: (i, j) + (0,) * len(tail))


def _per_row():
  return pl.BlockSpec((None,), lambda i, j: (i,))


@functools.partial(jax.jit, static_argnames=("interpret",))
def prologue(q_rot, cb_k, scale_k, n_comp, *, interpret: bool = False):
  """`prologue_reference` in one Pallas kernel (grid B × K). Shapes as there; G must divide 8."""
  b, kh, g, h = q_rot.shape
  if N % g:
    raise ValueError(f"q_rot has G={g} query heads per kv head: the group size must divide {N}")
  if h % 128:
    raise ValueError(f"head_dim={h} must be a multiple of 128")
  out_shape = [jax.ShapeDtypeStruct((b, kh, N, h), jnp.int8), jax.ShapeDtypeStruct((b, kh, QS_SLOTS), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, N, 2 * OUTLIERS), jnp.float16),
               jax.ShapeDtypeStruct((b, kh, N), jnp.float32)]
  return pl.pallas_call(
      _prologue_kernel, grid=(b, kh),
      in_specs=[_spec(g, h), _spec(h, 4), _spec(OUTLIERS), _per_row()],
      out_specs=[_spec(N, h), _spec(QS_SLOTS), _spec(N, 2 * OUTLIERS), _spec(N)],
      out_shape=out_shape, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="oskvp_uniform_prologue",
  )(q_rot.astype(jnp.float32), cb_k.astype(jnp.float32), scale_k.astype(jnp.float32), n_comp.astype(jnp.int32))


def epilogue_channels(splits: int) -> int:
  """Output channels per epilogue program: 32 while a program's acc block (splits × HC × 8 f32) stays ≤ 16 KB."""
  return 32 if splits <= 16 else 16


def epilogue_shape_error(window: int, splits: int, head_dim: int) -> str | None:
  """Why `epilogue` cannot take a window of R tokens, this many splits and head dim (Triton tiles are powers of
  two), or None."""
  if window < 16 or window & (window - 1) or splits & (splits - 1):
    return f"the window R={window} (at least 16) and splits={splits} must be powers of two"
  if head_dim % epilogue_channels(splits):
    return f"head_dim={head_dim} must be a multiple of {epilogue_channels(splits)}"
  return None


@functools.partial(jax.jit, static_argnames=("interpret",))
def epilogue(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res, *, interpret: bool = False):
  """`epilogue_reference` in one Pallas kernel (grid B × K × H/HC, `epilogue_channels`). Shapes as there; the window
  R and the splits must be powers of two (Triton tiles), R ≥ 16."""
  b, kh, splits, h, _ = acc.shape
  g, r = q_rot.shape[2], res_k.shape[2]
  error = epilogue_shape_error(r, splits, h)
  if error:
    raise ValueError(error)
  hc = epilogue_channels(splits)
  spec = lambda *tail, cols=None: pl.BlockSpec(
      (None, None, *tail), lambda i, j, c: (i, j) + tuple(c if k == cols else 0 for k in range(len(tail))))
  return pl.pallas_call(
      _epilogue_kernel, grid=(b, kh, h // hc),
      in_specs=[spec(splits, hc, N, cols=1), spec(splits, QS_SLOTS), spec(splits, OUTLIERS, N), spec(g, h), spec(N),
                spec(hc, 4, cols=0), spec(OUTLIERS), spec(r, h), spec(r, hc, cols=1),
                pl.BlockSpec((None,), lambda i, j, c: (i,))],
      out_specs=spec(ROWS, hc, cols=1),
      out_shape=jax.ShapeDtypeStruct((b, kh, ROWS, h), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="oskvp_uniform_epilogue",
  )(acc, ml, acco, q_rot.astype(jnp.float32), qc, cb_v.astype(jnp.float32), scale_v.astype(jnp.float32), res_k,
    res_v, n_res.astype(jnp.int32))
