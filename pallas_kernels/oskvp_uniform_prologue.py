"""The query preparation of the wired Mosaic GPU OS-KVP path as one Pallas (Triton) kernel
(`uniform_decode_attention(glue="pallas")`), one program per batch row b and kv head k.

Input: the rotated query q' = q U_k [G, H] (an XLA matmul), the key codebooks cb_k = c0 + d·code [H, 4], the key
outlier scales [8], the row's compressed length n_comp. With c = log2(e) / √H it writes what the core reads:
  qd int8 [8, H]    round(q'·d / u) per head, u = max_ch |q'·d| / 127 (rows G.. zero): the query digits
  qs f32 [32]       u·c in [0, G), n_comp at index 8 (the core's `qs_row`)
  qo f16 [8, 16]    q'[:, :8]·scale_k·c (the key-outlier query; columns 8.. zero)
  qc f32 [8]        c·Σ q'·c0 (the score part the codes do not carry)
The reference is the jnp glue's `query_digits` and `outlier_query` (`prologue_reference`); digits may differ on an
exact rounding tie (half away from zero here, half to even there).

`rotating_prologue` takes the unrotated query and U_k [H, H] instead (H = 128) and computes q' itself on the tensor
cores (three bf16 dots of hi + lo parts, ~2^-16 relative), returning it for the epilogue: the XLA matmul before the
prologue goes (`uniform_decode_attention(query_rotation="prologue")`). Reference: `rotating_prologue_reference`.
The eleventh session's form of it took ~130 µs a call on the H200 and was reverted (notes_mgpu_oskvp.md §15): its
q'[:, :16] by a one-hot dot makes a pip Triton's ptxas spill ~10 KB a thread; here those channels are an exact
masked sum (no spill). On an H100 it is 0.7–4.0% slower by GPU span than the XLA matmul + `prologue` in six cells
(64k / 16k / 4k × batch 8 / 1; results/decode_attention_qrot_h100_s45.md, notes §27): not the earlier form's
slowdown, but no gain, so it is not the default.

On the H200 (results/decode_attention_mosaic_glue.md) this kernel and `oskvp_uniform_epilogue` make the path five
GPU kernels instead of ~19 and 9–22% faster by GPU time at batch 1 and 8 up to 16k. Their first form (ninth
session: the rotation inside, f32 products in chunks) took 14 µs at 64k × 8
(results/oskvp_uniform_profile_pallas_glue.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.oskvp_decode_core_mgpu import LEN_SLOT, N, OUTLIERS, QS_SLOTS
from pallas_kernels.oskvp_decode_attention import MMA_ROWS
from pallas_kernels.oskvp_decode_prologue import live_rows, round_half_away, split_dot, unfold_rows
from pallas_kernels.oskvp_uniform_glue import LOG2E, outlier_query, query_digits

LEAD = 2 * OUTLIERS  # the key-outlier query's columns: the f16 wgmma's K, channels 0..7 and 8 zero columns
ROTATING_HEAD_DIM = 128  # the one head dim `rotating_prologue` takes


def _query_parts(q, q_lead, cb_ref, sk_ref, nc_ref, qd_ref, qs_ref, qo_ref, qc_ref):
  # q [G, H] f32 (rotated) and q_lead = q[:, :16] as values (Triton values take no slices); cb_ref [H, 4] f32;
  # sk_ref [8] f32; nc_ref [] int32. qd_ref [8, H] int8; qs_ref [32] f32; qo_ref [8, 16] f16; qc_ref [8] f32.
  g, h = q.shape
  c = h**-0.5 * LOG2E
  c0 = cb_ref[:, 0]
  qf = q * (cb_ref[:, 1] - c0)[None, :]  # [G, H]
  u = jnp.maximum(jnp.abs(qf).max(axis=1), 1e-30) / 127.0  # [G]
  qd_ref[...] = unfold_rows([round_half_away(qf / u[:, None])], N, jnp.int8)
  slots = jnp.arange(QS_SLOTS)
  qs = unfold_rows([(u * c)[:, None]], QS_SLOTS, jnp.float32).reshape(QS_SLOTS)
  qs_ref[...] = jnp.where(slots == LEN_SLOT, nc_ref[...].astype(jnp.float32), jnp.where(slots < g, qs, 0.0))
  scale = plgpu.load(sk_ref.at[pl.ds(0, LEAD)], mask=jnp.arange(LEAD) < OUTLIERS, other=0.0)  # [16]
  qo_ref[...] = unfold_rows([q_lead * (scale[None, :] * c)], N, jnp.float16)
  qc = unfold_rows([((q * c0[None, :]).sum(axis=1) * c)[:, None]], N, jnp.float32).reshape(N)
  qc_ref[...] = jnp.where(jnp.arange(N) < g, qc, 0.0)


def _prologue_kernel(q_ref, *refs):
  # q_ref [G, H] f32 (rotated); the rest as `_query_parts`'.
  _query_parts(q_ref[...], q_ref[:, pl.ds(0, LEAD)], *refs)


def _lead_channels(x):
  """x [G, H] -> x[:, :LEAD] [G, LEAD] exactly, by a masked sum over a [G, H, LEAD] one-hot (Triton values take no
  slices; a second, narrow dot on U_k's first columns instead spilled ~11 KB a thread in ptxas)."""
  h = x.shape[1]
  onehot = jax.lax.broadcasted_iota(jnp.int32, (h, LEAD), 0) == jax.lax.broadcasted_iota(jnp.int32, (h, LEAD), 1)
  return jnp.where(onehot[None], x[:, :, None], 0.0).sum(axis=1)


def _rotating_prologue_kernel(q_ref, u_ref, cb_ref, sk_ref, nc_ref, qr_ref, *refs):
  # q_ref [G, H] (unrotated, the query's dtype); u_ref [H, H] f32 (U_k). qr_ref [G, H] f32: q' = q U_k, which the
  # epilogue reads; the rest as `_query_parts`'.
  g = q_ref.shape[0]
  q16 = unfold_rows([q_ref[...].astype(jnp.float32)], MMA_ROWS, jnp.float32)  # [16, H]: a tensor-core tile
  q_rot = live_rows(split_dot(q16, u_ref[...]), g)
  qr_ref[...] = q_rot
  _query_parts(q_rot, _lead_channels(q_rot), cb_ref, sk_ref, nc_ref, *refs)


def _spec(*tail):
  return pl.BlockSpec((None, None, *tail), lambda i, j: (i, j) + (0,) * len(tail))


def _per_row():
  return pl.BlockSpec((None,), lambda i, j: (i,))


def _check_shapes(g: int, h: int):
  if N % g:
    raise ValueError(f"the query has G={g} heads per kv head: the group size must divide {N}")
  if h % 128:
    raise ValueError(f"head_dim={h} must be a multiple of 128")


def _out_shapes(b: int, kh: int, h: int) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct((b, kh, N, h), jnp.int8), jax.ShapeDtypeStruct((b, kh, QS_SLOTS), jnp.float32),
          jax.ShapeDtypeStruct((b, kh, N, LEAD), jnp.float16), jax.ShapeDtypeStruct((b, kh, N), jnp.float32)]


def _out_specs(h: int) -> list[pl.BlockSpec]:
  return [_spec(N, h), _spec(QS_SLOTS), _spec(N, LEAD), _spec(N)]


@functools.partial(jax.jit, static_argnames=("interpret",))
def prologue(q_rot, cb_k, scale_k, n_comp, *, interpret: bool = False):
  """`prologue_reference` in one Pallas kernel (grid B × K). Shapes as there; G must divide 8."""
  b, kh, g, h = q_rot.shape
  _check_shapes(g, h)
  return pl.pallas_call(
      _prologue_kernel, grid=(b, kh),
      in_specs=[_spec(g, h), _spec(h, 4), _spec(OUTLIERS), _per_row()],
      out_specs=_out_specs(h), out_shape=_out_shapes(b, kh, h),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
      name="oskvp_uniform_prologue",
  )(q_rot.astype(jnp.float32), cb_k.astype(jnp.float32), scale_k.astype(jnp.float32), n_comp.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def rotating_prologue(q, u_k, cb_k, scale_k, n_comp, *, interpret: bool = False):
  """The query rotation and `prologue` in one Pallas kernel (grid B × K): q [B, K, G, H] unrotated (any float
  dtype; G divides 8, H = 128), u_k f32 [B, K, H, H] -> (q' = q U_k f32 [B, K, G, H], qd, qs, qo, qc as `prologue`
  returns them).

  The rotation runs on the tensor cores as three bf16 dots of hi + lo parts (`split_dot`, ~2^-16 relative to the
  f32 product), so the wired path needs no XLA matmul before its prologue. Reference: `rotating_prologue_reference`.
  """
  b, kh, g, h = q.shape
  _check_shapes(g, h)
  if h != ROTATING_HEAD_DIM:
    raise ValueError(f"head_dim={h}: rotating_prologue takes H={ROTATING_HEAD_DIM} (U_k and its bf16 parts in a "
                     "program's registers); rotate in XLA and call `prologue`")
  return pl.pallas_call(
      _rotating_prologue_kernel, grid=(b, kh),
      in_specs=[_spec(g, h), _spec(h, h), _spec(h, 4), _spec(OUTLIERS), _per_row()],
      out_specs=[_spec(g, h), *_out_specs(h)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, g, h), jnp.float32), *_out_shapes(b, kh, h)],
      # 8 warps: at H = 128, U_k and its two bf16 parts take 243 registers a thread with 4 (98 with 8, no spills
      # either way in a pip Triton's ptxas for sm_90; not timed)
      compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1), interpret=interpret,
      name="oskvp_uniform_rotating_prologue",
  )(q, u_k.astype(jnp.float32), cb_k.astype(jnp.float32), scale_k.astype(jnp.float32), n_comp.astype(jnp.int32))


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


@jax.jit
def rotating_prologue_reference(q, u_k, cb_k, scale_k, n_comp):
  """q [B, K, G, H], u_k [B, K, H, H] -> (q' = q U_k in f32 at full precision, then `prologue_reference`'s four)."""
  q_rot = jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32), u_k.astype(jnp.float32), precision="highest")
  return (q_rot, *prologue_reference(q_rot, cb_k, scale_k, n_comp))
