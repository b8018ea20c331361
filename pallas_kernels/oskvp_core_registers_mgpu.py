"""Register-level pieces of the fused OS-KVP core's GPU route (`oskvp_decode_core_mgpu.py`), in inline Mosaic.

The core's GPU route builds some wgmma operands and stores some tiles by hand, element by element in Mosaic's
WGMMA register layout, where the Pallas level has no form for them:
- `store_transposed`: a WGMMA-layout array [T, C] into a swizzled shared-memory tile [R, T], transposed (p8 as the
  value side's B operand, p8's e4m3 parts as the fp8 value-outlier A operand);
- `key_outlier_fragment`, `value_outlier_fragment`: the f16 A operands of the outlier wgmmas, built in registers
  from fp8 tiles (2-byte and 8-byte loads, one cvt per pair), with their index math (`key_outlier_source`,
  `value_outlier_source`, `k_to_token` / `token_to_k`).
The index math is written once over an arithmetic interface: `Ints` (Python ints: the CPU tests check it against
Mosaic's layout tables) and `Mlir` (i32 / index values inside the kernel). The CPU interpreter runs no inline
Mosaic; the core's interpret route does these steps with jnp instead.
"""

from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.lib.mlir.dialects import llvm
from jax._src.lib.mlir.dialects import memref
from jax._src.lib.mlir.dialects import vector
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

OUTLIERS = 8  # fp8 outlier channels per side: the key-outlier rows [S/2, 16] hold two tokens' 8 channels


def store_transposed(arr, ref, transforms, column_map=None, row_offset: int = 0, column_offset: int = 0):
  """Inside the kernel (GPU route): arr [T, C] in the WGMMA layout -> ref [R >= C + row_offset, T' >= T +
  column_offset] with element (t, c) at ref[c + row_offset, t + column_offset] (transposed; int32 values are
  truncated to an int8 ref), or at ref[c + row_offset, column_map(ops, t)] (a permutation of the columns; no
  column_offset). `transforms` are the ref's (tiles of 8 × tc elements, a swizzle of sw bytes), and the swizzle is
  applied by hand: the 16-byte chunk index ^= the row's address bits 7+. The other rows of ref are left as they were."""
  if column_map is not None and column_offset:
    raise ValueError(f"column_offset={column_offset} with a column_map: the map places every column")
  (tiling, swizzle) = transforms
  tc, sw = tiling.tiling[-1], swizzle.swizzle
  itemsize = jnp.dtype(ref.dtype).itemsize
  chunk_shift = (16 // itemsize).bit_length() - 1  # log2 of the elements per 16-byte chunk
  row_tiles, col_tiles = ref.shape[0] // 8, ref.shape[1] // tc

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(transforms)))
  def store(_, arr, ref):  # ref: the tiled memref [R / 8, T / tc, 8, tc]
    index = ir.IndexType.get()
    c = lambda v: mgpu.utils.c(v, index)
    elem = ir.MemRefType(ref.type).element_type
    zero = c(0)

    def one(val, idx):  # idx = (arr row t: a column of ref, arr column n: a row of ref)
      t, n = idx
      if row_offset:
        n = arith.addi(n, c(row_offset))
      if column_map is not None:
        t = column_map(Mlir(index), t)
      elif column_offset:
        t = arith.addi(t, c(column_offset))
      tile_r, r = (zero, n) if row_tiles == 1 else (arith.divui(n, c(8)), arith.remui(n, c(8)))
      tile_t, tt = (zero, t) if col_tiles == 1 else (arith.divui(t, c(tc)), arith.remui(t, c(tc)))
      phys = arith.xori(tt, arith.shli(swizzle_chunk_xor(Mlir(index), r, tc * itemsize, sw), c(chunk_shift)))
      if val.type != elem:
        val = arith.trunci(elem, val)
      memref.store(val, ref, [tile_r, tile_t, r, phys])

    arr.foreach(one)

  store(arr, ref)


def swizzle_chunk_xor(ops, row, row_bytes: int, sw: int):
  """The swizzle of a TMA tile (8 rows of `row_bytes` a tile, swizzled by `sw` bytes): what row `row` (within its
  8-row tile) XORs into the index of each of its 16-byte chunks (the row's address bits 7+)."""
  return ops.band(ops.shr(ops.mul(row, row_bytes), 7), sw // 16 - 1)


F16_T_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
F16_B16_TRANSFORMS = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))


class Ints:
  """Integer arithmetic on Python ints (the CPU model of the fragment index math)."""
  add = staticmethod(lambda a, b: a + b)
  mul = staticmethod(lambda a, k: a * k)
  shr = staticmethod(lambda a, k: a >> k)
  shl = staticmethod(lambda a, k: a << k)
  div = staticmethod(lambda a, k: a // k)
  mod = staticmethod(lambda a, k: a % k)
  band = staticmethod(lambda a, k: a & k)
  bor = staticmethod(lambda a, b: a | b)
  bxor = staticmethod(lambda a, b: a ^ b)


class Mlir:
  """The same arithmetic on i32 MLIR values (inside `plgpu.inline_mgpu`); constants are Python ints."""

  def __init__(self, ty=None):
    self.ty = ir.IntegerType.get_signless(32) if ty is None else ty

  def value(self, a):
    """a as an MLIR value of the ops' type (a Python int becomes a constant)."""
    return mgpu.utils.c(a, self.ty) if isinstance(a, int) else a

  def add(self, a, b):
    return a + b if isinstance(a, int) and isinstance(b, int) else arith.addi(self.value(a), self.value(b))

  def mul(self, a, k):
    return a * k if isinstance(a, int) else arith.muli(a, self.value(k))

  def shr(self, a, k):
    return a >> k if isinstance(a, int) else arith.shrui(a, self.value(k))

  def shl(self, a, k):
    return a << k if isinstance(a, int) else arith.shli(a, self.value(k))

  def div(self, a, k):
    return a // k if isinstance(a, int) else arith.divui(a, self.value(k))

  def mod(self, a, k):
    return a % k if isinstance(a, int) else arith.remui(a, self.value(k))

  def band(self, a, k):
    return a & k if isinstance(a, int) else arith.andi(a, self.value(k))

  def bor(self, a, b):
    return a | b if isinstance(a, int) and isinstance(b, int) else arith.ori(self.value(a), self.value(b))

  def bxor(self, a, b):
    return a ^ b if isinstance(a, int) and isinstance(b, int) else arith.xori(self.value(a), self.value(b))


def key_outlier_source(ops, idx: tuple[int, ...], warp, lane):
  """Register idx = (m, c, 0, 0, h, ...) of the key-outlier A operand (f16 [block_s, 16], WGMMA layout: thread
  (warp, lane) holds tokens t = 64m + 16·warp + lane // 4 + 8h, columns 8c + 2·(lane % 4) + 0..1) -> (row, column)
  of its fp8 pair in the tile [block_s / 2, 16] (token t's 8 channels at row t // 2, columns 8·(t % 2) + 0..7), or
  None for the zero columns 8..15."""
  m, c, h = idx[0], idx[1], idx[4]
  if c:
    return None
  row = ops.add(32 * m + 4 * h, ops.add(ops.mul(warp, 8), ops.shr(lane, 3)))  # t // 2 (64m, 16·warp, 8h even)
  col = ops.add(ops.mul(ops.band(ops.shr(lane, 2), 1), 8), ops.mul(ops.band(lane, 3), 2))
  return row, col


def value_outlier_source(ops, idx: tuple[int, ...], warp, lane):
  """Register idx = (0, kt, 0, 0, h, ...) of the value-outlier A operand (f16 [64, block_s], WGMMA layout: thread
  (warp, lane) holds row lane // 4 + 8h (+ 16·warp), columns 8·kt + 2·(lane % 4) + 0..1; row r is channel r % 8, the
  8 channels repeated) -> (row, column) of its fp8 pair in the tile [8, block_s] (channels × tokens), with the
  columns permuted so that a thread's 8 columns of a 32-column group are 8 consecutive tokens (one 8-byte load):
  column k holds token `k_to_token(k)`, and p is stored with the same permutation (`token_to_k`)."""
  del warp
  kt = idx[1]  # = 4g + pair, g the 32-token group
  return ops.shr(lane, 2), ops.add(32 * (kt // 4) + 2 * (kt % 4), ops.mul(ops.band(lane, 3), 8))


def k_to_token(ops, k):
  """Column k of the value-outlier A operand (and row k of p16) -> its token, within each group of 32:
  k = 16c + 8j + 2a + b -> t = 8a + 4c + 2j + b (a thread's columns of a group, fixed a, are 8 consecutive tokens)."""
  t = ops.bor(ops.band(k, ~31 & 0xFFFF), ops.shl(ops.band(ops.shr(k, 1), 3), 3))
  t = ops.bor(t, ops.shl(ops.band(ops.shr(k, 4), 1), 2))
  return ops.bor(t, ops.bor(ops.shl(ops.band(ops.shr(k, 3), 1), 1), ops.band(k, 1)))


def token_to_k(ops, t):
  """The inverse of `k_to_token`: t = 8a + 4c + 2j + b -> k = 16c + 8j + 2a + b (within each group of 32)."""
  k = ops.bor(ops.band(t, ~31 & 0xFFFF), ops.shl(ops.band(ops.shr(t, 2), 1), 4))
  k = ops.bor(k, ops.shl(ops.band(ops.shr(t, 1), 1), 3))
  return ops.bor(k, ops.bor(ops.shl(ops.band(ops.shr(t, 3), 3), 1), ops.band(t, 1)))


def cvt_e4m3x2(pair16):
  """i16 (two fp8 e4m3 bytes) -> vector<2xf16> (one cvt.rn.f16x2.e4m3x2)."""
  i32 = ir.IntegerType.get_signless(32)
  out = llvm.inline_asm(i32, [pair16], "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
  return mgpu.utils.bitcast(out, ir.VectorType.get((2,), ir.F16Type.get()))


def thread_coords(ops):
  tid = mgpu.utils.thread_idx()
  return ops.band(ops.shr(tid, 5), 3), ops.band(tid, 31)  # warp in the warpgroup, lane


def key_outlier_fragment(tile, block_s: int):
  """Inside the kernel (GPU route): the key-outlier tile fp8 [block_s / 2, 16] (unswizzled) -> the f16
  [block_s, 16] A operand in the WGMMA layout (`key_outlier_source`): one 2-byte load and one cvt per register."""
  shape = (block_s, 2 * OUTLIERS)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct(shape, jnp.float16, plgpu.Layout.WGMMA))
  def frag(_, ref):
    ops, index = Mlir(), ir.IndexType.get()
    i16 = ir.IntegerType.get_signless(16)
    pair8 = ir.VectorType.get((2,), ir.Float8E4M3FNType.get())
    warp, lane = thread_coords(ops)
    regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
    zero = mgpu.utils.c(0.0, ir.VectorType.get((2,), ir.F16Type.get()))
    for idx in np.ndindex(regs.shape):
      src = key_outlier_source(ops, idx, warp, lane)
      if src is None:
        regs[idx] = zero
        continue
      row, col = (arith.index_cast(index, ops.value(v)) for v in src)
      regs[idx] = cvt_e4m3x2(mgpu.utils.bitcast(vector.load(pair8, ref, [row, col]), i16))
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return frag(tile)


def value_outlier_fragment(tile, block_s: int, transforms):
  """Inside the kernel (GPU route): the value-outlier tile fp8 [8, block_s] (swizzled, `transforms`) -> the f16
  [64, block_s] A operand in the WGMMA layout with permuted columns (`value_outlier_source`): per 32 tokens one
  8-byte load and four cvts per thread; the two row halves (h) share the registers."""
  shape = (64, block_s)
  (tiling, swizzle) = transforms
  tc, sw = tiling.tiling[-1], swizzle.swizzle

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),),
                     return_type=plgpu.ShapeDtypeStruct(shape, jnp.float16, plgpu.Layout.WGMMA))
  def frag(_, ref):  # ref: the tiled memref [1, block_s / tc, 8, tc]
    ops, index = Mlir(), ir.IndexType.get()
    i16, i64 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(64)
    oct8 = ir.VectorType.get((8,), ir.Float8E4M3FNType.get())
    warp, lane = thread_coords(ops)
    regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
    for g in range(block_s // 32):
      row, col = value_outlier_source(ops, (0, 4 * g, 0, 0, 0), warp, lane)
      phys = ops.bxor(ops.band(col, tc - 1), ops.shl(swizzle_chunk_xor(ops, row, tc, sw), 4))
      as_index = lambda v: arith.index_cast(index, ops.value(v))
      zero = mgpu.utils.c(0, index)
      word = vector.load(oct8, ref, [zero, as_index(ops.shr(col, tc.bit_length() - 1)), as_index(row), as_index(phys)])
      word = mgpu.utils.bitcast(word, i64)
      for pair in range(4):
        reg = cvt_e4m3x2(arith.trunci(i16, arith.shrui(word, mgpu.utils.c(16 * pair, i64))))
        regs[0, 4 * g + pair, 0, 0, 0, 0, 0, 0, 0] = regs[0, 4 * g + pair, 0, 0, 1, 0, 0, 0, 0] = reg
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return frag(tile)
