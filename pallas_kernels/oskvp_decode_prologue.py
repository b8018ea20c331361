"""The bit-plane decode kernel's query inputs in one small Pallas kernel (one program per batch row and kv head).

Reference: `prepare_bitplane_query` + `compact_query` in `oskvp_decode_attention_bitplane.py` (plain jnp), which
XLA compiles into about eight small fusions (the rotation, the max-abs reduction, rounding, padding, two
concatenations...). On the H200 each costs a launch and a gap in a decode step: at batch 1 the call's other kernels
and gaps took longer than the attention kernel itself (`benchmarks/results/decode_attention_breakdown.md`). This
kernel replaces them with one launch.

Per program (batch row b, kv head k), with qr = (q U_k) / sqrt(H) the rotated query [G, H] and (c0, d1, ...) the key
codebooks' multilinear coefficients (`multilinear_coefficients`: c0, d1, d2, d3 for 4 levels; 8 for 3-bit keys, whose
seven plane types the kernel reads), channel j = p Q + i of plane p:
  qc [G] = sum_j qr_j c0_j;   the folded query q'·d_type [G, H] per plane type, scaled by qs = max |q'·d| / 127 per
  row and split into int8 digits hi = round(x), lo = round(256 (x - hi)) (x = q'·d / qs);
  qd [T, 4, R, Q] int8: hi in rows < G, lo in rows G..2G-1, zero below;  qw [R]: qs in rows < G, qs / 256 in G..2G-1;
  qp [4, R, Q] bf16: qr by plane in rows < G;  qo [R, OP]: qr_j scale_k_j for the O outlier channels, rows < G.
The rotation is an exact f32 multiply-add reduction on the CUDA cores (G x H x H = 64k per program at G = 4, H = 128),
matching the reference's HIGHEST-precision einsum to f32 rounding; a digit can differ from the reference's only where
x sits within f32 rounding of a rounding boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def unfold_rows(parts, rows: int, dtype):
  """[G, n] arrays -> [rows, n] with part i in rows iG..iG+G-1, zero elsewhere (Triton tiles: no concatenate)."""
  groups, n = parts[0].shape
  sel = jax.lax.broadcasted_iota(jnp.int32, (rows // groups, groups, n), 0)
  out = jnp.zeros((rows // groups, groups, n), dtype)
  for i, part in enumerate(parts):
    out = jnp.where(sel == i, jnp.broadcast_to(part.astype(dtype)[None], out.shape), out)
  return out.reshape(rows, n)


def live_rows(x, g: int):
  """x [rows, n] -> its first g rows [g, n] (g divides rows; the inverse of `unfold_rows` with one part): Triton
  values take no slices, so the rows are split into rows / g groups of g and the first group kept by a masked sum."""
  parts = x.reshape(x.shape[0] // g, g, x.shape[1])
  first = jax.lax.broadcasted_iota(jnp.int32, parts.shape, 0) == 0
  return jnp.where(first, parts, 0.0).sum(axis=0)


def split_dot(a, b):
  """a f32 [M, K] @ b [K, N] on the tensor cores in bf16, f32 sums: each f32 operand as bf16 hi + lo parts, the lo·lo
  term dropped (relative error ~2^-16). A bf16 b has no lo part: two dots; an f32 b: three."""
  def parts(x):
    hi = x.astype(jnp.bfloat16)
    return hi, (None if x.dtype == jnp.bfloat16 else (x - hi.astype(jnp.float32)).astype(jnp.bfloat16))
  (a_hi, a_lo), (b_hi, b_lo) = parts(a), parts(b)
  dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
  out = dot(a_hi, b_hi) + dot(a_lo, b_hi)
  return out if b_lo is None else out + dot(a_hi, b_lo)


def round_half_away(x):
  """Round half away from zero (the reference rounds half to even: they differ only on exact ties)."""
  return jnp.where(x >= 0, jnp.floor(x + 0.5), -jnp.floor(0.5 - x))


def _prologue_kernel(q_ref, u_ref, cb_ref, sk_ref, qd_ref, qw_ref, qc_ref, qp_ref, qo_ref, *, o_dim: int,
                     types: int, two_digits: bool):
  # q_ref [G, H] (query dtype); u_ref [H, H] f32; cb_ref [H, L] (codebook rows, L = 4 or 8); sk_ref [O] f32.
  # qd_ref [T, 4, R, Q] int8; qw_ref [R] f32; qc_ref [G] f32; qp_ref [4, R, Q] bf16; qo_ref [R, OP] f16 / bf16.
  g, h = q_ref.shape
  r, q_dim = qp_ref.shape[1], qp_ref.shape[2]
  op = qo_ref.shape[1]
  q = q_ref[...].astype(jnp.float32)  # [G, H]

  def rotate(cols):  # qr[:, cols] [G, n]: an exact f32 multiply-add reduction over H
    return (q[:, :, None] * u_ref[:, cols][None]).sum(axis=1) * h**-0.5

  qc = jnp.zeros((g,), jnp.float32)
  folded, amax = [], jnp.zeros((g,), jnp.float32)
  for p in range(4):
    qr = rotate(pl.ds(p * q_dim, q_dim))  # [G, Q]
    qp_ref[p] = unfold_rows([qr], r, qp_ref.dtype)
    rows = pl.ds(p * q_dim, q_dim)
    levels = cb_ref.shape[1]
    cb = [cb_ref[rows, c].astype(jnp.float32) for c in range(levels)]  # [Q] each
    if levels == 8 and types == 4:  # symmetric 3-bit keys: as `symmetric_coefficients_3bit`
      # prod_{i in mask} (2 b_i - 1) of code c: -1 for an odd count of zero bits in the mask.
      sign = lambda c, mask: -1.0 if bin(~c & mask).count("1") % 2 else 1.0  # noqa: E731
      w = [sum(sign(c, mask) * cb[c] for c in range(8)) * 0.125 for mask in (1, 2, 4, 7)]
      cb = [sum(cb) * 0.125 - w[0] - w[1] - w[2] - w[3]] + [2.0 * x for x in w]
    else:
      for bit in range(levels.bit_length() - 1):  # Moebius inversion, as `multilinear_coefficients`
        cb = [x - cb[m ^ (1 << bit)] if m & (1 << bit) else x for m, x in enumerate(cb)]
    deltas = cb[1:1 + types]
    qc += (qr * cb[0][None]).sum(axis=1)
    folded.append([qr * d[None] for d in deltas])
    for x in folded[-1]:
      amax = jnp.maximum(amax, jnp.abs(x).max(axis=1))
  qs = jnp.maximum(amax, 1e-30) / 127.0  # [G]
  for p in range(4):
    for t in range(types):
      x = folded[p][t] / qs[:, None]  # in [-127, 127]
      hi = round_half_away(x)
      parts = [hi]
      if two_digits:
        parts.append(jnp.clip(round_half_away((x - hi) * 256.0), -127.0, 127.0))
      qd_ref[t, p] = unfold_rows(parts, r, jnp.int8)
  col = qs[:, None]
  qw_ref[...] = unfold_rows([col, col / 256.0] if two_digits else [col], r, jnp.float32).reshape(r)
  qc_ref[...] = qc
  scale = plgpu.load(sk_ref.at[pl.ds(0, op)], mask=jnp.arange(op) < o_dim, other=0.0)  # [OP]
  qo = rotate(pl.ds(0, op)) * scale[None, :]
  qo_ref[...] = unfold_rows([qo], r, qo_ref.dtype)


@functools.partial(jax.jit, static_argnames=["rows", "o_cols", "types", "digits", "outlier_dtype", "interpret"])
def compact_query_pallas(q, u_k, cb_k, scale_k, *, rows: int, o_cols: int, types: int, digits: int,
                         outlier_dtype, interpret: bool = False):
  """The compact bit-plane kernel's query inputs in one Pallas kernel.

  Args:
    q [B, N, H]; u_k [B, K, H, H] f32; cb_k [B, K, H, L], L = 4 or 8 levels; scale_k [B, K, O].
    rows: R, the tensor-core tile's rows (>= 2 G with two digits); o_cols: OP >= O, a power of two.
    types: plane types (3, or 2 with symmetric codebooks; 7 for 8 levels, 4 for symmetric 8 levels); digits: 1 or 2
      int8 digits of the folded query.

  Returns:
    qd int8 [B, K, T, 4, R, Q], qw f32 [B, K, R], qc f32 [B, K, G], qp bf16 [B, K, 4, R, Q], qo [B, K, R, OP] in
    outlier_dtype: what `prepare_bitplane_query` + `compact_query` return for the compact kernel.
  """
  b, n, h = q.shape
  kh, o_dim, levels = u_k.shape[1], scale_k.shape[-1], cb_k.shape[-1]
  g, qd = n // kh, h // 4
  if levels not in (4, 8) or types >= levels:
    raise ValueError(f"cb_k has {levels} levels: needs 4 or 8, and more than {types=}")
  if digits == 2 and 2 * g > rows:
    raise ValueError(f"two query digits need 2 G <= rows (got G = {g}, {rows=})")

  def spec(*tail):
    return pl.BlockSpec((None, None, *tail), lambda i, j: (i, j) + (0,) * len(tail))

  out_shape = [jax.ShapeDtypeStruct((b, kh, types, 4, rows, qd), jnp.int8),
               jax.ShapeDtypeStruct((b, kh, rows), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, g), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, 4, rows, qd), jnp.bfloat16),
               jax.ShapeDtypeStruct((b, kh, rows, o_cols), outlier_dtype)]
  kernel = functools.partial(_prologue_kernel, o_dim=o_dim, types=types, two_digits=digits == 2)
  return pl.pallas_call(
      kernel,
      grid=(b, kh),
      in_specs=[spec(g, h), spec(h, h), spec(h, levels), spec(o_dim)],
      out_specs=[spec(types, 4, rows, qd), spec(rows), spec(g), spec(4, rows, qd), spec(rows, o_cols)],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="oskvp_decode_prologue",
  )(q.reshape(b, kh, g, h), u_k.astype(jnp.float32), cb_k, scale_k.astype(jnp.float32))
