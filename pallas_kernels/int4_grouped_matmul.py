"""Grouped (ragged) matmul reading int4 weights, dequantized inside the kernel; dense or 2:4-sparse.

Contract of `jax.lax.ragged_dot`: out[m] = lhs[m] @ W[e(m)] for rows m of expert e (rows sorted by expert), with

  W[e, k, n] = (q[e, k, n] - z[e, k // G, n]) · s[e, k // G, n] / a[e, k]

q in [0, 15], G the group size along K (128), s a float scale and z an integer zero point per (group, column), and a
an optional per-input-channel activation scale (AWQ; the kernel multiplies lhs by 1/a, stored as `in_scale`).

Layouts (Kp = K padded to a multiple of G; within K group g, local index r):
  dense, kernel layout, `packed` uint16 [E, N, Kp/4] (`to_nk_layout`; what the quantizer stores): word
    (n, g·G/4 + c) holds in nibble j (bits 4j..4j+3) k = g·G + (G/4)·j + c, j = 0..3.
  dense `packed` uint8 [E, Kp/2, N]: row g·G/2 + r holds k = g·G + r (low nibble) and k = g·G + G/2 + r (high).
  2:4 `packed` uint8 [E, Kp/4, N] + `meta` uint8 [E, Kp/8, N]: K group g splits into G/4 quads; quad r holds
    k = g·G + r + (G/4)·j for j = 0..3, of which two are kept. Row g·G/4 + r of `packed` holds the first kept value
    (low nibble) and the second (high); row g·G/8 + r' of `meta` holds the 4-bit keep mask of quad r' (low nibble)
    and of quad r' + G/8 (high). A pruned weight dequantizes to exactly 0 (q = z).
  `scale` [E, Kp/G, N] (bf16 or f32), `zero` uint8 [E, Kp/G, N], `in_scale` f32 [E, Kp] or None.

Per K group the kernel computes s · (x @ q - rowsum(x) · z): the zero point and scale act on the [rows, N] tile, so
the only per-weight work is unpacking nibbles to the matmul dtype. 4 bits/weight (+ 24 bits per G for s and z);
2:4 stores 2 values + a 4-bit mask per 4 weights: 3 bits/weight.

Two kernels share the ragged skeleton of `ragged_tiles`:
  uint16 layout (decode): out^T = W^T x^T per (expert, N tile, K split). The decoded weight is the left (A) operand
    of Hopper's wgmma, taken from registers, so Triton converts the layout of the packed words (cp.async -> shared ->
    registers in the mma operand layout) and the nibbles decode in place: a shift and a lop3 per 2 weights (PTX),
    no shared-memory round trip of the bf16 tile; rows are the narrow N side of the tile (8, or 16 from 9 rows per
    expert); the rows' group sums come from XLA; split-K when few (expert, N tile) programs have rows.
  uint8 layout (dense or 2:4): x @ W with the decoded tile as the right operand (mma.sync, M = rows padded to 16).
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
# PTX for the uint16 layout: 2 words (2 columns of the [bn, G/4] tile, one 32-bit register) -> nibble j of each as
# the bf16 pair 128 + q: a shift and one lop3 per 2 weights, no byte permutes (elementwise in any register layout).
_ASM_U16 = ["{{\n.reg .b32 t;\n{shift}lop3.b32 $0, {src}, 0x000F000F, 0x43004300, 0xEA;\n}}".format(
    shift="" if j == 0 else f"shr.b32 t, $1, {4 * j};\n", src="$1" if j == 0 else "t") for j in range(4)]
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


def _unpack_asm_u16(p, j: int):
  """uint16 [bn, k] -> 128 + nibble j, bf16 [bn, k] (GPU only)."""
  out = [jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)]
  return plgpu.elementwise_inline_asm(_ASM_U16[j], args=[p], constraints="=r,r", pack=2,
                                      result_shape_dtypes=out)[0]


def _to_float(q, dtype, magic: bool):
  """int32 q in [0, 15] -> dtype. magic: the bf16 bit pattern 0x4300 | q is exactly 128 + q (ulp 1 at 128), built
  with two integer ops instead of int -> float conversions (quarter rate on the GPU); the caller folds the 128 into
  the zero point."""
  if magic and dtype == jnp.bfloat16:
    return jax.lax.bitcast_convert_type((q | 0x4300).astype(jnp.uint16), jnp.bfloat16)
  return q.astype(dtype)


def _col(v, transposed: bool):
  """[bn] per-column values -> [1, bn], or [bn, 1] for a transposed tile."""
  return v[:, None] if transposed else v[None, :]


def _rowsum(x, transposed: bool):
  """[bm, k] -> float32 [bm, 1], or [1, bm] for a transposed tile."""
  r = jnp.sum(x.astype(jnp.float32), axis=1)
  return r[None, :] if transposed else r[:, None]


def _scaled_x(load_x, ws: Int4Weights, e):
  def x_at(k0, size):  # [bm, size], times 1/a when the weights carry activation scales
    x = load_x(k0, size)
    if ws.in_scale is not None:  # float16 stays float32 once scaled: 1/a is large on a channel quiet at
      scaled = x.astype(jnp.float32) * ws.in_scale[e, pl.ds(k0, size)][None, :]  # calibration; x/a passes 65504
      x = scaled if x.dtype == jnp.float16 else scaled.astype(x.dtype)
    return x
  return x_at


def _finish(acc, d, xs, ws: Int4Weights, e, g, nt, shift: bool, transposed: bool):
  """acc + s · (d - xs · z): scale and zero point on the tile (z + 128 when q was decoded as 128 + q)."""
  s = _col(ws.scale[e, g, nt].astype(jnp.float32), transposed)
  z = _col(ws.zero[e, g, nt].astype(jnp.float32), transposed) + (128.0 if shift else 0.0)
  return acc + s * d - (s * z) * xs


def _step_kn(load_x, ws: Int4Weights, e, g, n0, acc, *, group_size: int, bn: int, unpack: str = "magic"):
  """acc float32 [bm, bn] + K group g of expert e for columns n0 : n0 + bn, weights in the uint8 layout."""
  gs, nt = group_size, pl.ds(n0, bn)
  x_at = _scaled_x(load_x, ws, e)
  magic = unpack in ("magic", "asm")
  shift = {"on": False}

  def dot(x, q):
    use_magic = magic and x.dtype == jnp.bfloat16
    shift["on"] = use_magic
    return jnp.dot(x, _to_float(q, x.dtype, use_magic), preferred_element_type=jnp.float32)

  if ws.meta is None:
    half = gs // 2
    x_lo, x_hi = x_at(g * gs, half), x_at(g * gs + half, half)  # [bm, G/2] each
    p = ws.packed[e, pl.ds(g * half, half), nt]  # uint8 [G/2, bn]
    if unpack == "asm" and x_lo.dtype == jnp.bfloat16:
      lo, hi = _unpack_asm(p)  # bf16 [G/2, bn]: 128 + q
      d = (jnp.dot(x_lo, lo, preferred_element_type=jnp.float32)
           + jnp.dot(x_hi, hi, preferred_element_type=jnp.float32))
      shift["on"] = True
    else:
      p = p.astype(jnp.int32)
      d = dot(x_lo, p & 15) + dot(x_hi, p >> 4)
    xs = _rowsum(x_lo, False) + _rowsum(x_hi, False)
  else:
    quarter, eighth = gs // 4, gs // 8
    z = ws.zero[e, g, nt].astype(jnp.int32)[None, :]  # [1, bn]
    d, xs = 0.0, 0.0
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
        xs = xs + _rowsum(x, False)
  return _finish(acc, d, xs, ws, e, g, nt, shift["on"], False)


def _step_nk(load_x, ws: Int4Weights, e, g, n0, acc, *, group_size: int, bn: int, unpack: str = "asm"):
  """acc float32 [bn, bm] + K group g of expert e for columns n0 : n0 + bn (transposed), uint16 layout.

  Computes W^T x^T so that the decoded weight is the left (A) tensor-core operand, kept in registers: Triton moves
  the layout conversion onto the packed words (shared memory holds only them) and the nibbles decode in the mma
  register layout; the rows of lhs are the narrow N side of the tile (8 or 16).
  """
  q4, nt = group_size // 4, pl.ds(n0, bn)
  x_at = _scaled_x(load_x, ws, e)
  p = ws.packed[e, nt, pl.ds(g * q4, q4)]  # uint16 [bn, G/4]
  xj = [x_at(g * group_size + j * q4, q4) for j in range(4)]  # [bm, G/4] each
  asm = unpack == "asm" and xj[0].dtype == jnp.bfloat16
  magic = asm or (unpack == "magic" and xj[0].dtype == jnp.bfloat16)
  d = None
  for j, x in enumerate(xj):  # decode nibble j right before its dot: one decoded tile live at a time
    if asm:
      w = _unpack_asm_u16(p, j)  # bf16 [bn, G/4]: 128 + q
    else:
      w = _to_float((p.astype(jnp.int32) >> (4 * j)) & 15, x.dtype, magic)
    dj = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bn, bm]
    d = dj if d is None else d + dj
  if hasattr(load_x, "rowsum") and ws.in_scale is None:
    xs = load_x.rowsum(g)[None, :]  # [1, bm], summed by XLA before the kernel
  else:
    xs = sum(_rowsum(x, True) for x in xj)  # [1, bm]
  return _finish(acc, d, xs, ws, e, g, nt, magic, True)


def _unpack_mode(unpack: str, interpret: bool) -> str:
  if unpack not in UNPACKS:
    raise ValueError(f"unpack={unpack!r} must be one of {UNPACKS}")
  return "magic" if (unpack == "asm" and interpret) else unpack  # inline PTX has no interpreter


def is_nk(ws: Int4Weights) -> bool:
  """Whether `ws.packed` is in the uint16 [E, N, Kp/4] kernel layout (else uint8 [E, Kp/2 or Kp/4, N])."""
  return ws.packed.dtype == jnp.uint16


def _check(lhs, ws: Int4Weights, group_size: int, what: str = "weights"):
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, Kp] (rows sorted by expert), got shape {lhs.shape}")
  if is_nk(ws):
    if ws.meta is not None:
      raise ValueError("the uint16 [E, N, Kp/4] layout is dense only; keep 2:4 weights in the uint8 layout")
    e, n, words = ws.packed.shape
    kp = words * 4
  else:
    e, rows, n = ws.packed.shape
    per = group_size // 4 if ws.meta is not None else group_size // 2
    kp = rows // per * group_size
  if lhs.shape[1] != kp:
    raise ValueError(f"lhs has K={lhs.shape[1]} but the int4 weights hold Kp={kp}; pad lhs with zeros to Kp")
  if group_size % (128 if ws.meta is not None else 32) or kp % group_size:
    raise ValueError(f"group_size={group_size} must be a multiple of 32 (128 for 2:4) dividing Kp={kp}")
  if ws.scale.shape != (e, kp // group_size, n):
    raise ValueError(f"{what}.scale has shape {ws.scale.shape} but group_size={group_size} needs "
                     f"{(e, kp // group_size, n)}: pass the group_size the weights were quantized with")
  if ws.zero.shape != ws.scale.shape:  # read at the scale's indices: a smaller one past its end
    raise ValueError(f"{what}.zero has shape {ws.zero.shape}, not the scale's {ws.scale.shape}")
  return e, kp, n


def _plan(lhs, weight_sets, group_sizes, group_size, block_m, block_n, split_k, unpack, interpret):
  """Checks the weights and picks the step, tile sizes, split-K and orientation shared by the public functions."""
  layouts = {is_nk(w) for w in weight_sets}
  if len(layouts) > 1:
    raise ValueError("fused weights must share one layout (all uint16 [E, N, Kp/4] or all uint8)")
  nk = layouts.pop()
  names = ("weights",) if len(weight_sets) == 1 else ("gate", "up")
  shapes = [_check(lhs, w, group_size, what) for w, what in zip(weight_sets, names)]
  e, kp, n = shapes[0]
  for w, what, shape in zip(weight_sets, names, shapes):
    ragged_tiles.check_same_shape(shapes[0], shape)
    ragged_tiles.check_grouped_args(group_sizes, w.in_scale, e, kp, what)
  bn = ragged_tiles.pick_block_n(n, block_n)
  m, n_groups = lhs.shape[0], kp // group_size
  bm = block_m or ragged_tiles.pick_block_m(m, e, smallest=8 if nk else 16)
  if split_k is None:
    split_k = ragged_tiles.pick_split_k(m, e, n // bn, n_groups) if nk else 1
  step = functools.partial(_step_nk if nk else _step_kn, group_size=group_size, bn=bn,
                           unpack=_unpack_mode(unpack, interpret))
  rowsums = None
  if nk and all(w.in_scale is None for w in weight_sets):
    # Sums of lhs over each K group for the zero-point term, in float32 of the same values the matmul sees.
    rowsums = lhs.astype(jnp.float32).reshape(m, n_groups, group_size).sum(axis=2).T  # [Kg, M]
  return dict(step=step, n=n, n_groups=n_groups, block_m=bm, block_n=bn, split_k=split_k, transposed=nk,
              group_rowsums=rowsums)


_STATIC = ("group_size", "block_m", "block_n", "num_warps", "num_stages", "interpret", "poison", "unpack", "split_k")


@functools.partial(jax.jit, static_argnames=_STATIC)
def int4_grouped_matmul(lhs: jax.Array, weights: Int4Weights, group_sizes: jax.Array, *, group_size: int = 128,
                        block_m: int | None = None, block_n: int = 128, num_warps: int = 4, num_stages: int = 3,
                        interpret: bool = False, poison: float | None = None, unpack: str = "asm",
                        split_k: int | None = None) -> jax.Array:
  """lhs [M, Kp] (rows sorted by expert) @ int4 W [E, Kp, N] per group_sizes [E] -> float32 [M, N].

  Weights in the uint16 [E, N, Kp/4] layout (`to_nk_layout`) run the A/B-swapped kernel (W^T x^T, the fast decode
  path); uint8 weights (dense or 2:4) run x @ W. split_k None: automatic (more programs when few have rows).
  """
  plan = _plan(lhs, [weights], group_sizes, group_size, block_m, block_n, split_k, unpack, interpret)
  return ragged_tiles.ragged_call(lhs, group_sizes, [weights], plan.pop("step"), num_warps=num_warps,
                                  num_stages=num_stages, interpret=interpret, poison=poison, **plan)


@functools.partial(jax.jit, static_argnames=_STATIC)
def int4_grouped_swiglu(lhs: jax.Array, gate: Int4Weights, up: Int4Weights, group_sizes: jax.Array, *,
                        group_size: int = 128, block_m: int | None = None, block_n: int = 128, num_warps: int = 4,
                        num_stages: int = 3, interpret: bool = False, poison: float | None = None,
                        unpack: str = "asm", split_k: int | None = None) -> jax.Array:
  """Fused gate/up + SwiGLU: silu(lhs @ W_gate) * (lhs @ W_up), one pass over lhs -> lhs.dtype [M, F]."""
  plan = _plan(lhs, [gate, up], group_sizes, group_size, block_m, block_n, split_k, unpack, interpret)
  return ragged_tiles.ragged_call(lhs, group_sizes, [gate, up], plan.pop("step"),
                                  epilogue=lambda a: jax.nn.silu(a[0]) * a[1], out_dtype=lhs.dtype,
                                  num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison=poison,
                                  **plan)


@functools.partial(jax.jit, static_argnames=("group_size",))
def to_nk_layout(ws: Int4Weights, *, group_size: int = 128) -> Int4Weights:
  """Dense int4 weights, uint8 [E, Kp/2, N] -> the kernel's uint16 [E, N, Kp/4] layout (same values, run once).

  Word (n, g·G/4 + c) holds in nibble j the code of k = g·G + (G/4)·j + c, j = 0..3. Jitted; group_size is static.
  """
  if ws.meta is not None:
    raise ValueError("2:4 weights stay in the uint8 layout")
  if is_nk(ws):
    return ws
  q = codes_kn(ws, group_size)  # int32 [E, Kg, G, N]
  e, ng, _, n = q.shape
  q = q.reshape(e, ng, 4, group_size // 4, n)
  words = sum(q[:, :, j] << (4 * j) for j in range(4))  # [E, Kg, G/4, N]
  packed = jnp.moveaxis(words.reshape(e, ng * group_size // 4, n), 2, 1).astype(jnp.uint16)
  return ws._replace(packed=packed)


def codes_kn(ws: Int4Weights, group_size: int) -> jax.Array:
  """Dense codes q of either layout: int32 [E, Kg, G, N] (k = g·G + r)."""
  ng = ws.scale.shape[1]
  p = ws.packed.astype(jnp.int32)
  if is_nk(ws):
    e, n, _ = p.shape
    p = jnp.moveaxis(p, 1, 2).reshape(e, ng, group_size // 4, n)  # [E, Kg, G/4, N] words
    return jnp.concatenate([(p >> (4 * j)) & 15 for j in range(4)], axis=2)
  e, _, n = p.shape
  p = p.reshape(e, ng, group_size // 2, n)
  return jnp.concatenate([p & 15, p >> 4], axis=2)


@functools.partial(jax.jit, static_argnames=("group_size", "dtype"))
def dequantize_int4(ws: Int4Weights, *, group_size: int = 128, dtype=jnp.float32) -> jax.Array:
  """The weight the kernel multiplies by, in plain jnp: [E, Kp, N] in dtype. Jitted; group_size and dtype are static."""
  e, ng, n = ws.scale.shape
  z = ws.zero.astype(jnp.int32)[:, :, None, :]  # [E, Kg, 1, N]
  if ws.meta is None:
    q = codes_kn(ws, group_size)  # [E, Kg, G, N]
  else:
    p = ws.packed.astype(jnp.int32)
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


@functools.partial(jax.jit, static_argnames=("group_size",))
def int4_grouped_matmul_reference(lhs: jax.Array, weights: Int4Weights, group_sizes: jax.Array, *,
                                  group_size: int = 128) -> jax.Array:
  """XLA reference: dequantize to lhs.dtype, then `jax.lax.ragged_dot` with float32 accumulation (jitted; group_size
  is static)."""
  w = dequantize_int4(weights, group_size=group_size, dtype=lhs.dtype)
  return jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("group_size",))
def int4_grouped_swiglu_reference(lhs, gate: Int4Weights, up: Int4Weights, group_sizes, *, group_size=128):
  g = int4_grouped_matmul_reference(lhs, gate, group_sizes, group_size=group_size)
  u = int4_grouped_matmul_reference(lhs, up, group_sizes, group_size=group_size)
  return (jax.nn.silu(g) * u).astype(lhs.dtype)
