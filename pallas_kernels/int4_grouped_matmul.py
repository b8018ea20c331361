"""Grouped (ragged) matmul reading int4 weights, dequantized inside the kernel; dense or 2:4-sparse.

Contract of `jax.lax.ragged_dot`: out[m] = lhs[m] @ W[e(m)] for rows m of expert e (rows sorted by expert), with

  W[e, k, n] = (q[e, k, n] - z[e, k // G, n]) · s[e, k // G, n] / a[e, k]

q in [0, 15], G the group size along K (128), s a float scale and z an integer zero point per (group, column), and a
an optional per-input-channel activation scale (AWQ; the kernel multiplies lhs by 1/a, stored as `in_scale`).

Layouts (Kp = K padded to a multiple of G; within K group g, local index r):
  dense `packed` uint8 [E, Kp/2, N]: row g·G/2 + r holds k = g·G + r (low nibble) and k = g·G + G/2 + r (high).
  2:4 `packed` uint8 [E, Kp/4, N] + `meta` uint8 [E, Kp/8, N]: K group g splits into G/4 quads; quad r holds
    k = g·G + r + (G/4)·j for j = 0..3, of which two are kept. Row g·G/4 + r of `packed` holds the first kept value
    (low nibble) and the second (high); row g·G/8 + r' of `meta` holds the 4-bit keep mask of quad r' (low nibble)
    and of quad r' + G/8 (high). A pruned weight dequantizes to exactly 0 (q = z).
  `scale` [E, Kp/G, N] (bf16 or f32), `zero` uint8 [E, Kp/G, N], `in_scale` f32 [E, Kp] or None.

Per K group the kernel computes s · (x @ q - rowsum(x) · z): the zero point and scale act on the [rows, N] tile, so
the only per-weight work is unpacking nibbles to the matmul dtype. 4 bits/weight (+ 24 bits per G for s and z);
2:4 stores 2 values + a 4-bit mask per 4 weights: 3 bits/weight.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import ragged_tiles

# PTX: 4 packed bytes (4 columns, two nibbles each) -> 128 + their low (or high) nibbles as two bf16 pairs. prmt
# spreads bytes 0,1 (2,3) into the two 16-bit halves, lop3 computes (t & 0x000F000F) | 0x43004300 (0x4300 | q is the
# bf16 of 128 + q); the high-nibble variant shifts first. ~1.2 instructions per weight (the Marlin trick) where
# int -> float conversions cost several. (Two asm calls: Pallas lowers one result per inline asm.)
_UNPACK_ASM = """{{
.reg .b32 t0, t1;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;{shift}
lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
}}"""
_ASM_LO = _UNPACK_ASM.format(shift="")
_ASM_HI = _UNPACK_ASM.format(shift="\nshr.b32 t0, t0, 4;\nshr.b32 t1, t1, 4;")
UNPACKS = ("asm", "magic", "convert")


class Int4Weights(NamedTuple):
  """Raw arrays of one int4 expert weight [E, K, N] (see the module docstring for layouts)."""
  packed: jax.Array
  scale: jax.Array
  zero: jax.Array
  in_scale: jax.Array | None = None
  meta: jax.Array | None = None  # 2:4 keep masks; None for dense.


def _unpack_asm(p):
  """uint8 [R, bn] -> (128 + low nibbles, 128 + high nibbles), bf16 [R, bn] each (GPU only)."""
  out = [jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)]
  return tuple(plgpu.elementwise_inline_asm(asm, args=[p], constraints="=r,=r,r", pack=4, result_shape_dtypes=out)[0]
               for asm in (_ASM_LO, _ASM_HI))


def _to_float(q, dtype, magic: bool):
  """int32 q in [0, 15] -> dtype. magic: the bf16 bit pattern 0x4300 | q is exactly 128 + q (ulp 1 at 128), built
  with two integer ops instead of int -> float conversions (quarter rate on the GPU); the caller folds the 128 into
  the zero point."""
  if magic and dtype == jnp.bfloat16:
    return jax.lax.bitcast_convert_type((q | 0x4300).astype(jnp.uint16), jnp.bfloat16)
  return q.astype(dtype)


def _step(load_x, ws: Int4Weights, e, g, n0, *, group_size: int, bn: int, unpack: str = "magic"):
  """K group g of expert e for columns n0 : n0 + bn -> float32 [bm, bn]."""
  gs, nt = group_size, pl.ds(n0, bn)
  z = ws.zero[e, g, nt].astype(jnp.int32)[None, :]  # [1, bn]
  s = ws.scale[e, g, nt].astype(jnp.float32)[None, :]  # [1, bn]

  def x_at(k0, size):  # [bm, size]
    x = load_x(k0, size)
    if ws.in_scale is not None:
      x = (x.astype(jnp.float32) * ws.in_scale[e, pl.ds(k0, size)][None, :]).astype(x.dtype)
    return x

  shift = {"on": False}
  magic = unpack in ("magic", "asm")

  def dot(x, q):
    use_magic = magic and x.dtype == jnp.bfloat16
    shift["on"] = use_magic
    return jnp.dot(x, _to_float(q, x.dtype, use_magic), preferred_element_type=jnp.float32)

  def rowsum(x):
    return jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)

  if ws.meta is None:
    half = gs // 2
    x_lo, x_hi = x_at(g * gs, half), x_at(g * gs + half, half)  # [bm, G/2] each
    if unpack == "asm" and x_lo.dtype == jnp.bfloat16:
      lo, hi = _unpack_asm(ws.packed[e, pl.ds(g * half, half), nt])  # bf16 [G/2, bn]: 128 + q
      d = (jnp.dot(x_lo, lo, preferred_element_type=jnp.float32)
           + jnp.dot(x_hi, hi, preferred_element_type=jnp.float32))
      shift["on"] = True
    else:
      p = ws.packed[e, pl.ds(g * half, half), nt].astype(jnp.int32)  # [G/2, bn]
      d = dot(x_lo, p & 15) + dot(x_hi, p >> 4)
    xs = rowsum(x_lo) + rowsum(x_hi)
  else:
    quarter, eighth = gs // 4, gs // 8
    d = jnp.zeros((1, bn), jnp.float32)
    xs = jnp.zeros((1, 1), jnp.float32)
    for h in range(2):  # quads r' and r' + G/8 share a meta byte
      v = ws.packed[e, pl.ds(g * quarter + h * eighth, eighth), nt].astype(jnp.int32)  # [G/8, bn]
      mask = (ws.meta[e, pl.ds(g * eighth, eighth), nt].astype(jnp.int32) >> (4 * h)) & 15  # [G/8, bn]
      v0, v1 = v & 15, v >> 4
      b = [((mask >> j) & 1) == 1 for j in range(4)]
      # Kept slot j takes the first value unless an earlier slot was kept; pruned slots take z (dequant -> 0).
      w = [jnp.where(b[0], v0, z), jnp.where(b[1], jnp.where(b[0], v1, v0), z),
           jnp.where(b[2], jnp.where(b[0] | b[1], v1, v0), z), jnp.where(b[3], v1, z)]
      for j in range(4):
        x = x_at(g * gs + j * quarter + h * eighth, eighth)  # [bm, G/8]
        d = d + dot(x, w[j])
        xs = xs + rowsum(x)
  zf = z.astype(jnp.float32) + (128.0 if shift["on"] else 0.0)  # q was decoded as 128 + q
  return s * (d - xs * zf)


def _unpack_mode(unpack: str, interpret: bool) -> str:
  if unpack not in UNPACKS:
    raise ValueError(f"unpack={unpack!r} must be one of {UNPACKS}")
  return "magic" if (unpack == "asm" and interpret) else unpack  # inline PTX has no interpreter


def _check(lhs, ws: Int4Weights, group_size: int):
  e, rows, n = ws.packed.shape
  per = group_size // 4 if ws.meta is not None else group_size // 2
  kp = rows // per * group_size
  if lhs.shape[1] != kp:
    raise ValueError(f"lhs has K={lhs.shape[1]} but the int4 weights hold Kp={kp}; pad lhs with zeros to Kp")
  if group_size % (128 if ws.meta is not None else 32):
    raise ValueError(f"group_size={group_size} must be a multiple of 32 (128 for 2:4)")
  return e, kp, n


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "num_warps", "num_stages",
                                             "interpret", "poison", "unpack"))
def int4_grouped_matmul(lhs: jax.Array, weights: Int4Weights, group_sizes: jax.Array, *, group_size: int = 128,
                        block_m: int | None = None, block_n: int = 128, num_warps: int = 4, num_stages: int = 3,
                        interpret: bool = False, poison: float | None = None, unpack: str = "asm") -> jax.Array:
  """lhs [M, Kp] (rows sorted by expert) @ int4 W [E, Kp, N] per group_sizes [E] -> float32 [M, N]."""
  _, kp, n = _check(lhs, weights, group_size)
  bn = ragged_tiles.pick_block_n(n, block_n)
  step = functools.partial(_step, group_size=group_size, bn=bn, unpack=_unpack_mode(unpack, interpret))
  return ragged_tiles.ragged_call(lhs, group_sizes, [weights], step, n=n, n_groups=kp // group_size,
                                  block_m=block_m, block_n=bn, num_warps=num_warps, num_stages=num_stages,
                                  interpret=interpret, poison=poison)


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "num_warps", "num_stages",
                                             "interpret", "poison", "unpack"))
def int4_grouped_swiglu(lhs: jax.Array, gate: Int4Weights, up: Int4Weights, group_sizes: jax.Array, *,
                        group_size: int = 128, block_m: int | None = None, block_n: int = 128, num_warps: int = 4,
                        num_stages: int = 3, interpret: bool = False, poison: float | None = None,
                        unpack: str = "asm") -> jax.Array:
  """Fused gate/up + SwiGLU: silu(lhs @ W_gate) * (lhs @ W_up), one pass over lhs -> lhs.dtype [M, F]."""
  _, kp, n = _check(lhs, gate, group_size)
  bn = ragged_tiles.pick_block_n(n, block_n)
  step = functools.partial(_step, group_size=group_size, bn=bn, unpack=_unpack_mode(unpack, interpret))
  return ragged_tiles.ragged_call(lhs, group_sizes, [gate, up], step, n=n, n_groups=kp // group_size,
                                  epilogue=lambda a: jax.nn.silu(a[0]) * a[1], out_dtype=lhs.dtype,
                                  block_m=block_m, block_n=bn, num_warps=num_warps, num_stages=num_stages,
                                  interpret=interpret, poison=poison)


def dequantize_int4(ws: Int4Weights, *, group_size: int = 128, dtype=jnp.float32) -> jax.Array:
  """The weight the kernel multiplies by, in plain jnp: [E, Kp, N] in dtype."""
  e, rows, n = ws.packed.shape
  p = ws.packed.astype(jnp.int32)
  ng = ws.scale.shape[1]
  z = ws.zero.astype(jnp.int32)[:, :, None, :]  # [E, Kg, 1, N]
  if ws.meta is None:
    p = p.reshape(e, ng, group_size // 2, n)
    q = jnp.concatenate([p & 15, p >> 4], axis=2)  # [E, Kg, G, N]
  else:
    quarter, eighth = group_size // 4, group_size // 8
    v = p.reshape(e, ng, quarter, n)
    m = ws.meta.astype(jnp.int32).reshape(e, ng, eighth, n)
    mask = jnp.concatenate([m & 15, m >> 4], axis=2)  # [E, Kg, G/4, N] keep mask of each quad
    v0, v1 = v & 15, v >> 4
    b = [((mask >> j) & 1) == 1 for j in range(4)]
    w = [jnp.where(b[0], v0, z), jnp.where(b[1], jnp.where(b[0], v1, v0), z),
         jnp.where(b[2], jnp.where(b[0] | b[1], v1, v0), z), jnp.where(b[3], v1, z)]
    q = jnp.concatenate(w, axis=2)  # [E, Kg, G, N]: slot j of quad r is k = r + (G/4)·j
  w = (q - z).astype(jnp.float32) * ws.scale.astype(jnp.float32)[:, :, None, :]
  w = w.reshape(e, ng * group_size, n)
  if ws.in_scale is not None:
    w = w * ws.in_scale.astype(jnp.float32)[:, :, None]
  return w.astype(dtype)


def int4_grouped_matmul_reference(lhs: jax.Array, weights: Int4Weights, group_sizes: jax.Array, *,
                                  group_size: int = 128) -> jax.Array:
  """XLA reference: dequantize to lhs.dtype, then `jax.lax.ragged_dot` with float32 accumulation."""
  w = dequantize_int4(weights, group_size=group_size, dtype=lhs.dtype)
  return jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)


def int4_grouped_swiglu_reference(lhs, gate: Int4Weights, up: Int4Weights, group_sizes, *, group_size=128):
  g = int4_grouped_matmul_reference(lhs, gate, group_sizes, group_size=group_size)
  u = int4_grouped_matmul_reference(lhs, up, group_sizes, group_size=group_size)
  return (jax.nn.silu(g) * u).astype(lhs.dtype)
