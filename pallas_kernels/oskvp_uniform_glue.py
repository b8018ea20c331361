"""The prologue and epilogue of the wired Mosaic GPU OS-KVP path (`kv_cache="oskvp_uniform"`) as two small Pallas
(Triton) kernels, one program per batch row and kv head.

`moe_jax/kv_quant/oskvp_uniform_codes.uniform_decode_attention` (jnp) wraps the fused core
(`oskvp_decode_core_mgpu.py`) in about eighteen small XLA kernels: the query rotation and digits, pads, the merge
of the splits, the residual window's attention, the log-sum-exp merge and the rotation back. On the H200 at 64k ×
batch 8 they took 35 µs of kernel time (CUPTI, L2 flushed) next to the core's 147 µs
(`benchmarks/results/oskvp_uniform_profile.md`). These two kernels replace them:

prologue (per row b, kv head k; q' = q U_k the rotated query [G, H], c = log2(e) / √H, cb_k = c0 + d·code):
  qd int8 [8, H]    round(q'·d / u) per head, u = max_ch |q'·d| / 127 (rows G.. zero): the core's query digits
  qs f32 [32]       u·c in [0, G), the row's compressed length n_comp at index 8 (the core's `qs_row`)
  qo f16 [8, 16]    q'[:, :8]·scale_k·c (the key-outlier query; columns 8.. zero)
  qr f32 [16, H]    q' (rows G.. zero: the epilogue's window dot)
  qc f32 [8]        c·Σ q'·c0 (the score part the codes do not carry)
epilogue (the core's per-split outputs acc [splits, H, 8] (channel order), ml [splits, 32] (m, l), acco
[splits, 8, 8]):
  the splits merged by log-sum-exp, o' = c0_v + d_v·mean code (+ the value outliers · scale_v on channels 0..7),
  exact attention over the window (res_k, res_v [R, H], n_res tokens), the two merged by log-sum-exp and rotated
  back: o [16, H] = o' U_vᵀ (rows G.. meaningless).
The references are the jnp functions they replace (`prologue_reference`, `epilogue_reference`).

Measured on the H200 (results/oskvp_uniform_profile_pallas_glue.md), the first version **was slower than the XLA
glue it replaces**: at 64k × 8 the prologue took 40 µs and the epilogue 304 µs (the XLA glue: 35 µs in all). Each
program held [H, H] f32 tiles (U, res_k, res_v, and the [G, H, H] broadcast of the rotation) in the registers of 4
warps, which spills, with only B·K programs to hide it. The kernels were then restructured (not yet measured: the
session's device time was spent): the rotation goes 16 columns at a time ([G, H, 16] products), the splits are
summed one at a time, the window runs as an online softmax over 32-token chunks and U_vᵀ is applied 32 output
columns at a time, so no tile larger than [32, H] is live. Timed again (ninth session): prologue 14 µs, epilogue
60 µs, still slower than the XLA glue; `uniform_decode_attention` keeps glue="xla" as its default.
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

def prologue_reference(q, u_k, cb_k, scale_k, n_comp):
  """q [B, N, H], u_k [B, K, H, H], cb_k [B, K, H, 4], scale_k [B, K, 8], n_comp int32 [B] -> (qd int8 [B, K, 8, H],
  qs f32 [B, K, 32], qo f16 [B, K, 8, 16], qr f32 [B, K, 16, H], qc f32 [B, K, 8]) (module docstring): the jnp glue's
  `query_digits` and `outlier_query` on the rotated query, laid out as the kernel writes them."""
  b, n, h = q.shape
  kh = u_k.shape[1]
  g = n // kh
  qr = jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32).reshape(b, kh, g, h), u_k.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
  rows = qr.reshape(b * kh, g, h)
  qd, qs, qc = query_digits(rows, cb_k.reshape(b * kh, h, 4), h**-0.5)
  qo = outlier_query(rows, scale_k.reshape(b * kh, OUTLIERS), h**-0.5)
  qs = jnp.pad(qs, ((0, 0), (0, QS_SLOTS - N))).at[:, LEN_SLOT].set(jnp.repeat(n_comp, kh).astype(jnp.float32))
  per_head = lambda x: x.reshape(b, kh, *x.shape[1:])
  return (per_head(qd), per_head(qs), per_head(jnp.pad(qo, ((0, 0), (0, 0), (0, OUTLIERS)))),
          per_head(jnp.pad(rows, ((0, 0), (0, ROWS - g), (0, 0)))), per_head(jnp.pad(qc, ((0, 0), (0, N - g)))))


def epilogue_reference(acc, ml, acco, qr, qc, cb_v, scale_v, res_k, res_v, n_res, u_v):
  """The core's per-split outputs acc [B, K, S, H, 8] (channel order), ml [B, K, S, 32], acco [B, K, S, 8, 8]
  ([outlier channel, head]); the prologue's qr [B, K, 16, H], qc [B, K, 8]; cb_v [B, K, H, 4], scale_v [B, K, 8],
  res_k, res_v [B, K, R, H], n_res int32 [B], u_v [B, K, H, H] -> o f32 [B, K, 16, H] (rows G.. meaningless):
  `merge_splits`, the value codebooks and outliers, `window_attention`, `merge_lse2`, U_vᵀ."""
  b, kh, _, h, _ = acc.shape
  mean, mean_o, lse_c = merge_splits(acc, ml, acco)  # [B, K, 8, H], [B, K, 8, 8], [B, K, 8]
  c0, d = uniform_steps(cb_v)
  o_c = (c0[:, :, None, :] + d[:, :, None, :] * mean).at[..., :OUTLIERS].add(mean_o * scale_v[:, :, None, :])
  rows = lambda x: x.reshape(b * kh, *x.shape[2:])
  with jax.default_matmul_precision("highest"):
    o_r, lse_r = window_attention(rows(qr), rows(res_k), rows(res_v), jnp.repeat(n_res, kh), scale=h**-0.5)
  pad = ((0, 0), (0, ROWS - N))
  o, _ = merge_lse2(jnp.pad(rows(o_c), (*pad, (0, 0))), jnp.pad(rows(lse_c + qc), pad, constant_values=-jnp.inf),
                    o_r, lse_r)  # [BK, 16, H]
  return jnp.einsum("BKnj,BKhj->BKnh", o.reshape(b, kh, ROWS, h), u_v, precision=jax.lax.Precision.HIGHEST)


# ---- Kernels.

CHUNK = 16  # prologue: rotated-query columns per step ([G, H, 16] products, not [G, H, H])
WCHUNK = 32  # epilogue: output columns per step of U_vᵀ, and window tokens per step (16 for a window of 16·odd)


def _prologue_kernel(q_ref, u_ref, cb_ref, sk_ref, nc_ref, qd_ref, qs_ref, qo_ref, qr_ref, qc_ref):
  # q_ref [G, H]; u_ref [H, H] f32; cb_ref [H, 4] f32; sk_ref [8] f32; nc_ref [] int32.
  # qd_ref [8, H] int8; qs_ref [32] f32; qo_ref [8, 16] f16; qr_ref [16, H] f32; qc_ref [8] f32.
  # The rotation q' = q U_k goes CHUNK columns at a time (exact f32 multiply-add reductions of [G, H, CHUNK]); the
  # digits need max_ch |q'·d| first, so the chunks stay in registers ([G, H] in all) for the second pass.
  g, h = q_ref.shape
  c = h**-0.5 * LOG2E
  q = q_ref[...].astype(jnp.float32)
  chunks, folded = [], []
  amax, qc = jnp.zeros((g,), jnp.float32), jnp.zeros((g,), jnp.float32)
  for j in range(h // CHUNK):
    cols = pl.ds(j * CHUNK, CHUNK)
    qr = (q[:, :, None] * u_ref[:, cols][None]).sum(axis=1)  # [G, CHUNK]
    c0 = cb_ref[cols, 0]
    qf = qr * (cb_ref[cols, 1] - c0)[None, :]
    amax = jnp.maximum(amax, jnp.abs(qf).max(axis=1))
    qc += (qr * c0[None, :]).sum(axis=1)
    chunks.append(qr)
    folded.append(qf)
    qr_ref[:, cols] = jnp.where(jnp.arange(ROWS)[:, None] < g, unfold_rows([qr], ROWS, jnp.float32), 0.0)
  u = jnp.maximum(amax, 1e-30) / 127.0  # [G]
  for j, qf in enumerate(folded):
    qd_ref[:, pl.ds(j * CHUNK, CHUNK)] = unfold_rows([_round(qf / u[:, None])], N, jnp.int8)
  slots = jnp.arange(QS_SLOTS)
  qs = unfold_rows([(u * c)[:, None]], QS_SLOTS, jnp.float32).reshape(QS_SLOTS)
  qs_ref[...] = jnp.where(slots == LEN_SLOT, nc_ref[...].astype(jnp.float32), jnp.where(slots < g, qs, 0.0))
  scale = plgpu.load(sk_ref.at[pl.ds(0, CHUNK)], mask=jnp.arange(CHUNK) < OUTLIERS, other=0.0)  # [16]
  qo_ref[...] = unfold_rows([chunks[0] * (scale[None, :] * c)], N, jnp.float16)  # channels 0..7 (CHUNK = 16)
  qc = unfold_rows([(qc * c)[:, None]], N, jnp.float32).reshape(N)
  qc_ref[...] = jnp.where(jnp.arange(N) < g, qc, 0.0)


def _epilogue_kernel(acc_ref, ml_ref, ao_ref, qr_ref, qc_ref, cb_ref, sv_ref, rk_ref, rv_ref, nr_ref, u_ref, o_ref, *,
                     wchunk: int):
  # acc_ref [S, H, 8] f32 (channel order); ml_ref [S, 32]; ao_ref [S, 8, 8] ([outlier channel, head]);
  # qr_ref [16, H] f32; qc_ref [8]; cb_ref [H, 4]; sv_ref [8]; rk_ref, rv_ref [R, H] bf16; nr_ref []; u_ref [H, H].
  # o_ref [16, H] f32. The splits are summed one at a time, the window goes wchunk tokens at a time (online softmax)
  # and U_vᵀ WCHUNK output columns at a time: no tile larger than [WCHUNK, H] is live.
  splits, h = acc_ref.shape[0], acc_ref.shape[1]
  r = rk_ref.shape[0]
  hi = jax.lax.Precision.HIGHEST
  top = ml_ref[:, pl.ds(0, N)].max(axis=0)  # [8]

  def add_split(i, carry):
    mean, mean_o, total = carry
    w = jnp.exp2(ml_ref[i, pl.ds(0, N)] - top)  # [8]
    return (mean + acc_ref[i] * w[None, :], mean_o + ao_ref[i] * w[None, :],
            total + ml_ref[i, pl.ds(N, N)] * w)

  zero = lambda *shape: jnp.zeros(shape, jnp.float32)
  mean, mean_o, total = jax.lax.fori_loop(0, splits, add_split, (zero(h, N), zero(OUTLIERS, N), zero(N)))
  inv = 1.0 / jnp.maximum(total, 1e-30)
  mean, mean_o = (mean * inv[None, :]).T, (mean_o * inv[None, :]).T  # [8, H], [8 heads, 8 outlier channels]
  c0 = cb_ref[:, 0]
  o_c = c0[None, :] + (cb_ref[:, 1] - c0)[None, :] * mean  # [8, H]
  onehot = (jax.lax.broadcasted_iota(jnp.int32, (OUTLIERS, h), 0)
            == jax.lax.broadcasted_iota(jnp.int32, (OUTLIERS, h), 1)).astype(jnp.float32)  # [8, H]
  o_c += ((mean_o * sv_ref[...][None, :])[:, :, None] * onehot[None]).sum(axis=1)  # channels 0..7
  lse_c = jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30) / P_LEVELS) + qc_ref[...], -jnp.inf)
  qr = qr_ref[...]
  n_res = nr_ref[...]

  def window_chunk(i, carry):  # online softmax over the window, wchunk tokens per step
    m_r, l_r, o_r = carry
    rows = pl.ds(i * wchunk, wchunk)
    s = jnp.dot(qr, rk_ref[rows, :].astype(jnp.float32).T, precision=hi) * (h**-0.5 * LOG2E)  # [16, wchunk]
    live = jax.lax.broadcasted_iota(jnp.int32, (ROWS, wchunk), 1) + i * wchunk < n_res
    m_new = jnp.maximum(m_r, jnp.where(live, s, MASKED).max(axis=1))
    alpha = jnp.exp2(m_r - m_new)
    p = jnp.where(live, jnp.exp2(s - m_new[:, None]), 0.0)
    o_r = o_r * alpha[:, None] + jnp.dot(p, rv_ref[rows, :].astype(jnp.float32), precision=hi)
    return m_new, l_r * alpha + p.sum(axis=1), o_r

  m_r, total_r, o_r = jax.lax.fori_loop(0, r // wchunk, window_chunk,
                                        (jnp.full((ROWS,), MASKED, jnp.float32), zero(ROWS), zero(ROWS, h)))
  o_r = o_r / jnp.maximum(total_r, 1e-30)[:, None]
  lse_r = jnp.where(total_r > 0, m_r + jnp.log2(jnp.maximum(total_r, 1e-30)), -jnp.inf)
  o_c16 = unfold_rows([o_c], ROWS, jnp.float32)
  lse_c16 = jnp.where(jnp.arange(ROWS) < N, unfold_rows([lse_c[:, None]], ROWS, jnp.float32).reshape(ROWS), -jnp.inf)
  top2 = jnp.maximum(jnp.maximum(lse_c16, lse_r), MASKED)
  w1, w2 = jnp.exp2(lse_c16 - top2), jnp.exp2(lse_r - top2)
  o = (w1[:, None] * o_c16 + w2[:, None] * o_r) / jnp.maximum(w1 + w2, 1e-30)[:, None]
  for j in range(h // WCHUNK):  # o U_vᵀ, WCHUNK output columns at a time
    cols = pl.ds(j * WCHUNK, WCHUNK)
    o_ref[:, cols] = jnp.dot(o, u_ref[cols, :].T, precision=hi)


def _spec(*tail):
  return pl.BlockSpec((None, None, *tail), lambda i, j: (i, j) + (0,) * len(tail))


def _per_row():
  return pl.BlockSpec((None,), lambda i, j: (i,))


@functools.partial(jax.jit, static_argnames=("interpret",))
def prologue(q, u_k, cb_k, scale_k, n_comp, *, interpret: bool = False):
  """`prologue_reference` in one Pallas kernel (grid B × K). Shapes as there; G = N/K must divide 8."""
  b, n, h = q.shape
  kh = u_k.shape[1]
  g = n // kh
  if n % kh or N % g:
    raise ValueError(f"N={n} query heads over K={kh} kv heads: the group size must divide {N}")
  if h % CHUNK:
    raise ValueError(f"head_dim={h} must be a multiple of {CHUNK}")
  out_shape = [jax.ShapeDtypeStruct((b, kh, N, h), jnp.int8), jax.ShapeDtypeStruct((b, kh, QS_SLOTS), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, N, 2 * OUTLIERS), jnp.float16),
               jax.ShapeDtypeStruct((b, kh, ROWS, h), jnp.float32), jax.ShapeDtypeStruct((b, kh, N), jnp.float32)]
  return pl.pallas_call(
      _prologue_kernel, grid=(b, kh),
      in_specs=[_spec(g, h), _spec(h, h), _spec(h, 4), _spec(OUTLIERS), _per_row()],
      out_specs=[_spec(N, h), _spec(QS_SLOTS), _spec(N, 2 * OUTLIERS), _spec(ROWS, h), _spec(N)],
      out_shape=out_shape, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="oskvp_uniform_prologue",
  )(q.reshape(b, kh, g, h), u_k.astype(jnp.float32), cb_k.astype(jnp.float32), scale_k.astype(jnp.float32),
    n_comp.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def epilogue(acc, ml, acco, qr, qc, cb_v, scale_v, res_k, res_v, n_res, u_v, *, interpret: bool = False):
  """`epilogue_reference` in one Pallas kernel (grid B × K). Shapes as there."""
  b, kh, splits, h, _ = acc.shape
  r = res_k.shape[2]
  if r % 16 or h % WCHUNK:
    raise ValueError(f"the window R={r} must be a multiple of 16 and head_dim={h} of {WCHUNK}")
  wchunk = WCHUNK if r % WCHUNK == 0 else 16
  return pl.pallas_call(
      functools.partial(_epilogue_kernel, wchunk=wchunk), grid=(b, kh),
      in_specs=[_spec(splits, h, N), _spec(splits, QS_SLOTS), _spec(splits, OUTLIERS, N), _spec(ROWS, h), _spec(N),
                _spec(h, 4), _spec(OUTLIERS), _spec(r, h), _spec(r, h), _per_row(), _spec(h, h)],
      out_specs=_spec(ROWS, h),
      out_shape=jax.ShapeDtypeStruct((b, kh, ROWS, h), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="oskvp_uniform_epilogue",
  )(acc, ml, acco, qr, qc, cb_v.astype(jnp.float32), scale_v.astype(jnp.float32), res_k, res_v,
    n_res.astype(jnp.int32), u_v.astype(jnp.float32))
