"""Grouped (ragged) matmul reading int4 weights, in Mosaic GPU (Hopper: TMA pipeline + wgmma from registers).

Same contract as `jax.lax.ragged_dot` and `int4_grouped_matmul`: out[m] = lhs[m] @ W[e(m)] for the rows m of
expert e (rows sorted by expert), with the int4 weight of the quantizer

  W[e, k, n] = (q[e, k, n] - z[e, k // G, n]) · s[e, k // G, n],   q, z in [0, 15], G = 128.

Layout (`to_mgpu_layout`, converted once from the quantizer's `Int4Weights`; same 4 bits per weight):
  `q` int4 [E, N, Kp]: c = q - 8 (the signed nibble q ^ 8), K contiguous per column, in each block of 32 K
    positions permuted by `K_ORDER` (so that a loaded 32-bit word is already a wgmma operand fragment). The
    warp-specialized kernel also reads `K_ORDER_SHIFT` (`MgpuInt4WeightsShift`, `to_mgpu_layout(nibble_order="shift")`).
  `scale` bf16 [E, Kg, N]: s.   `zero` bf16 [E, Kg, N]: z - 8, so that W = (c - (z - 8)) · s.

Per (row tile, N tile) the kernel computes the transposed tile out^T[N_tile, W] = W^T x^T, so that the
dequantized weight tile [N_tile, 128] is the wgmma A operand, taken from registers, and x^T the B operand, read from
shared memory ([W, K_tile] K-major). TMA streams [N_tile, K_tile] int4 weight tiles and the x tile through a
`max_concurrent_steps`-deep ring (`plgpu.emit_pipeline`). Per K group of 128 a warpgroup loads the int4 tile in
Mosaic's 4X-upcast layout (one 32-bit shared-memory word = 8 nibbles per thread), which with `K_ORDER` already holds
the thread's wgmma fragments (reinterpreted, no lane exchange), dequantizes it to bf16 (`dequant="ptx"`: prmt,
lop3, sub.bf16x2, mul.bf16x2 per 2 weights; (q - z) is exact in bf16 and the one rounding of its product with s
gives the bf16 weight of the XLA reference) and issues the wgmma; the decode of group c + 1 overlaps the wgmma of
group c, and a step waits for its wgmmas before the next step decodes into the same registers.

Rows: a row tile is up to R (8 or 16) consecutive rows of one expert. XLA builds the table of tiles before the
kernel (expert, first row, row count, loaded row); an expert with more than R rows gets several tiles, an empty
expert none, and a virtual expert E covers the rows past sum(group_sizes), whose tiles store zeros. TMA loads lhs
into 8-row-tiled shared memory, so a tile loads the window of W = R + 8 rows that starts at the multiple of 8 at or
before its first row (rows of other experts are computed and dropped), and stores only its own rows of out [M, N]
(from shared memory, transposed on the way in) with a ladder of power-of-two row TMA stores.

CPU interpret mode (`interpret=True`, Mosaic GPU's interpreter) simulates TMA, barriers and wgmma, but it takes the
wgmma A operand from shared memory only and runs no inline PTX: there the tile is relaid out by Mosaic (lhs comes
in K_ORDER instead), dequantized with jnp and passed through a shared-memory buffer. The register reinterpretation
and the PTX dequant are checked on the GPU (`benchmarks/int4_mgpu_decode.py`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import ragged_tiles
from pallas_kernels.interpret_settle import settled_when_interpreted

_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout tile
# Stored K order within each block of 32: position 8p + v holds k = 8(v // 2) + 2p + v % 2 (p = 0..3, v = 0..7).
# A thread of the 4X-upcast layout loads 8 consecutive nibbles (one 32-bit word) at 8p; with this order they are
# exactly the four 2-element pairs the thread holds in the wgmma operand layout (columns 8c + 2p, 8c + 2p + 1 for
# c = 0..3), so the word is reinterpreted in place instead of exchanged between lanes (Marlin's offline shuffle).
K_ORDER = np.array([8 * (v // 2) + 2 * p + v % 2 for p in range(4) for v in range(8)])
# The "shift" nibble order (Marlin's interleave 0, 2, 4, 6, 1, 3, 5, 7): position 8p + v holds
# k = 8(v % 4) + 2p + v // 4, so that nibbles c and c + 4 of the word are the pair of column block c and
# (word >> 4c) & 0x000F000F puts them in the two 16-bit halves: one shift and one lop3 per pair, no prmt. Only the
# warp-specialized kernel reads it (`MgpuInt4WeightsShift`).
K_ORDER_SHIFT = np.array([8 * (v % 4) + 2 * p + v // 4 for p in range(4) for v in range(8)])
NIBBLE_ORDERS = {"prmt": K_ORDER, "shift": K_ORDER_SHIFT}
_G = 128  # K group of the scale and zero point: one wgmma K extent of the decoded tile


class MgpuInt4Weights(NamedTuple):
  """One int4 expert weight [E, K, N] in the Mosaic GPU kernel's layout (see the module docstring)."""
  q: jax.Array  # int4 [E, N, Kp]: q - 8
  scale: jax.Array  # bf16 [E, Kg, N]
  zero: jax.Array  # bf16 [E, Kg, N]: z - 8


class MgpuInt4WeightsShift(NamedTuple):
  """The same weight with q's nibbles in K_ORDER_SHIFT instead of K_ORDER (`to_mgpu_layout(nibble_order="shift")`)."""
  q: jax.Array  # int4 [E, N, Kp]: q - 8, K_ORDER_SHIFT within each block of 32
  scale: jax.Array  # bf16 [E, Kg, N]
  zero: jax.Array  # bf16 [E, Kg, N]: z - 8


def nibble_order(weights: MgpuInt4Weights | MgpuInt4WeightsShift) -> str:
  """"shift" for `MgpuInt4WeightsShift`, else "prmt" (K_ORDER)."""
  return "shift" if isinstance(weights, MgpuInt4WeightsShift) else "prmt"


@functools.partial(jax.jit, static_argnames=("group_size", "nibble_order"))
def to_mgpu_layout(ws: i4.Int4Weights, *, group_size: int = _G,  # pylint: disable=redefined-outer-name
                   nibble_order: str = "prmt") -> MgpuInt4Weights | MgpuInt4WeightsShift:
  """Dense int4 weights of the quantizer (either layout of `int4_grouped_matmul`) -> the Mosaic GPU layout, with
  the nibbles in K_ORDER ("prmt": `MgpuInt4Weights`) or K_ORDER_SHIFT ("shift": `MgpuInt4WeightsShift`). Jitted;
  group_size and nibble_order are static."""
  if nibble_order not in NIBBLE_ORDERS:
    raise ValueError(f"nibble_order={nibble_order!r} must be one of {tuple(NIBBLE_ORDERS)}")
  if ws.meta is not None or ws.in_scale is not None:
    raise ValueError("the Mosaic GPU int4 kernel takes dense weights without activation scales")
  if group_size != _G:
    raise ValueError(f"group_size={group_size} must be {_G} for the Mosaic GPU int4 kernel")
  codes = i4.codes_kn(ws, group_size)  # int32 [E, Kg, G, N]
  e, ng, _, n = codes.shape
  c = jnp.moveaxis(codes.reshape(e, ng * group_size, n), 2, 1) - 8  # [E, N, Kp] in [-8, 7]
  c = c.reshape(e, n, -1, 32)[..., NIBBLE_ORDERS[nibble_order]].reshape(e, n, ng * group_size)  # stored order
  cls = MgpuInt4WeightsShift if nibble_order == "shift" else MgpuInt4Weights
  return cls(c.astype(jnp.int4), ws.scale.astype(jnp.bfloat16),
             (ws.zero.astype(jnp.float32) - 8.0).astype(jnp.bfloat16))


@functools.partial(jax.jit, static_argnames=("m", "block_r", "m_loaded"))
def row_tiles(group_sizes: jax.Array, m: int, block_r: int, m_loaded: int | None = None) -> jax.Array:
  """The ragged row tiles: int32 [T, 4] rows (expert, first row, row count, first loaded row), T static.

  Expert e's rows are cut into tiles of `block_r`; the virtual expert E holds the rows past sum(group_sizes)
  (its tiles store zeros). Unused tiles have row count 0. Each tile loads a window of R + 8 rows that starts at a
  multiple of 8 (TMA into the 8-row-tiled shared memory of wgmma needs it) at or before its first row, clipped to
  M' - R - 8 (M' = m_loaded, the rows of the padded lhs; default M).
  """
  e = group_sizes.shape[0]
  # Cut as the Triton kernels' offsets: sizes summing past M made tiles store past the output.
  offsets = ragged_tiles.group_offsets(group_sizes, m)
  sizes = jnp.concatenate([jnp.diff(offsets), (m - offsets[-1])[None]])  # [E + 1]: the virtual expert E the rest
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes)[:-1]])
  n_tiles = -(-sizes // block_r)  # [E + 1]
  tile_end = jnp.cumsum(n_tiles)
  t_max = -(-m // block_r) + e + 1
  t = jnp.arange(t_max, dtype=jnp.int32)
  expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32), e)
  local = t - (tile_end[expert] - n_tiles[expert])
  first = starts[expert] + local * block_r
  count = jnp.clip(starts[expert] + sizes[expert] - first, 0, block_r)
  count = jnp.where(t < tile_end[-1], count, 0)
  loaded = jnp.clip(first // 8 * 8, 0, (m_loaded or m) - block_r - 8)
  return jnp.stack([expert, first, count, loaded], axis=1)


def swizzled(dtype, minor: int = _G):
  """Tiling + swizzle of a shared-memory tile read in column slices of `minor` elements (wgmma's K extent)."""
  bits = 4 if dtype == jnp.int4 else jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def as_wgmma_operand(w, block_n: int):
  """int4 [bn, G] in the 4X-upcast layout, stored in K_ORDER -> the same registers as the wgmma operand layout.

  Each 32-bit register (8 nibbles) becomes the four 2-nibble registers of column blocks 4b .. 4b + 3: no data
  moves (Mosaic's own relayout exchanges the words between lanes with two shuffles and permutes).
  """
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                     return_type=plgpu.ShapeDtypeStruct((block_n, _G), jnp.int4, plgpu.Layout.WGMMA))
  def reinterpret(_, arr):
    shape = (block_n, _G)
    regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)  # [bn/64, G/8, 1, 1, 2, 1, 1, 1, 1]
    for idx in np.ndindex(regs.shape):
      word = arr.registers[(idx[0], idx[1] // 4, *idx[2:])]
      regs[idx] = mgpu.utils.vector_slice(word, slice(2 * (idx[1] % 4), 2 * (idx[1] % 4) + 2))
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=True)
  return reinterpret(w)


# PTX: one 32-bit word of 8 stored nibbles (c = q - 8, i.e. the bits of q ^ 8) and the word shifted right by 4 ->
# the bf16 pair of weights 2i, 2i + 1: prmt puts byte i of each into the two 16-bit halves, lop3 computes
# (t & 0x000F000F) ^ 0x43084308, whose bf16 halves are 0x4300 | q = 128 + q exactly; sub.bf16x2 of 136 + z' =
# 128 + z leaves q - z (exact) and mul.bf16x2 by the scale rounds once, as the XLA reference does.
# 4 instructions per 2 weights; Mosaic's cast followed by jnp (w - z') * s takes 5.
_DEQUANT_ASM = """{{
.reg .b32 t;
prmt.b32 t, $1, $2, 0xF{hi}F{lo};
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6A;
sub.bf16x2 t, t, $3;
mul.bf16x2 $0, t, $4;
}}"""


def dequant_registers(w, *rows, n_rows: int, asm: str, shifts: tuple[int, int] = (0, -4),
                      nibble_order: str = "prmt"):  # pylint: disable=redefined-outer-name
  """int4 [n_rows, G] (4X-upcast layout, stored in the order's K permutation) and per-row bf16 [n_rows] operands ->
  bf16 [n_rows, G] wgmma operand, by inline PTX per bf16 pair.

  "prmt" order (K_ORDER): `asm` takes $1, $2 = the 32-bit word of 8 nibbles shifted by shifts[0] and shifts[1]
  (> 0 left, < 0 right) and {hi}/{lo} = the prmt byte selectors of the pair. "shift" order (K_ORDER_SHIFT): $1 = the
  word shifted right by 4 × the pair's index in the word (its two nibbles at bits 0-3 and 16-19). Then one operand
  per row array ($3, $4, ... / $2, ...), the row's value in both halves; $0 the pair.
  """
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, *[_ROW] * len(rows)),
                     return_type=plgpu.ShapeDtypeStruct((n_rows, _G), jnp.bfloat16, plgpu.Layout.WGMMA))
  def dequant(_, arr, *row_arrs):
    i32, bf16x2 = ir.IntegerType.get_signless(32), ir.VectorType.get((2,), ir.BF16Type.get())
    pair = lambda r: mgpu.utils.bitcast(mgpu.utils.vector_concat([r, r]), i32)  # one row value in both halves
    row_ops = ({idx: tuple(pair(r.registers[idx]) for r in row_arrs) for idx in np.ndindex(row_arrs[0].registers.shape)}
               if row_arrs else {})
    shift = lambda word, n: (word if n == 0 else arith.shli(word, mgpu.utils.c(n, i32)) if n > 0 else
                             arith.shrui(word, mgpu.utils.c(-n, i32)))
    words = {}
    regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((n_rows, _G)), dtype=object)
    for idx in np.ndindex(regs.shape):  # [n_rows/64, G/8, 1, 1, 2, 1, 1, 1, 1]
      src = (idx[0], idx[1] // 4, *idx[2:])
      part = idx[1] % 4
      if src not in words:
        word = mgpu.utils.bitcast(arr.registers[src], i32)
        words[src] = tuple(shift(word, n) for n in shifts) if nibble_order == "prmt" else word
      ops = words[src] if nibble_order == "prmt" else (shift(words[src], -4 * part),)
      ops = (*ops, *row_ops.get((idx[0], 0, idx[4], 0, 0), ()))
      out = llvm.inline_asm(i32, list(ops), asm.format(hi=part + 4, lo=part), "=r," + ",".join("r" * len(ops)))
      regs[idx] = mgpu.utils.bitcast(out, bf16x2)
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
  return dequant(w, *rows)


def _dequant_ptx(w, zz, s, block_n: int):
  """int4 [bn, G] (4X-upcast layout, K_ORDER), bf16 [bn] 136 + z' and scale rows -> bf16 [bn, G] wgmma operand."""
  return dequant_registers(w, zz, s, n_rows=block_n, asm=_DEQUANT_ASM, shifts=(0, -4))


def _kernel(tiles_ref, lhs_ref, q_ref, scale_ref, zero_ref, out_ref, sz_smem, o_smem, a_smem, bar, *, block_n: int,
            block_k: int, block_r: int, n_experts: int, n_groups: int, steps: int, a_from_smem: bool, dequant: str):
  # tiles_ref: int32 [T, 4] (row_tiles); lhs_ref: bf16 [M, Kp]; q_ref: int4 [E, N, Kp]; scale_ref, zero_ref:
  # bf16 [E, Kg, N]; out_ref: float32 [M, N]. sz_smem: bf16 [2, Kg, bn] (scale, zero' of this N tile);
  # o_smem: float32 [W, bn] (W = R + 8); a_smem: bf16 [bn, G] (interpret mode's route of the decoded tile);
  # bar: 2 barriers.
  t, j = jax.lax.axis_index("t"), jax.lax.axis_index("n")
  expert, first, count, loaded = (tiles_ref[t, i] for i in range(4))
  loaded = pl.multiple_of(loaded, 8)
  window = block_r + 8
  nt = pl.ds(j * block_n, block_n)

  @pl.when(count > 0)
  def _tile():
    def acc_scope(acc_ref):  # acc_ref: float32 [bn, W], out^T
      @pl.when(expert < n_experts)
      def _stream():
        plgpu.copy_gmem_to_smem(scale_ref.at[expert, :, nt], sz_smem.at[0], bar.at[0])
        plgpu.copy_gmem_to_smem(zero_ref.at[expert, :, nt], sz_smem.at[1], bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])

        def step(idx, q_smem, x_smem):  # q_smem: int4 [bn, block_k]; x_smem: bf16 [W, block_k]
          (kk,) = idx
          for c in range(block_k // _G):
            g = kk * (block_k // _G) + c
            ks = pl.ds(c * _G, _G)
            w = plgpu.load(q_smem.at[:, ks], layout=plgpu.Layout.WGMMA_UPCAST_4X)  # int4 [bn, G]
            s = plgpu.load(sz_smem.at[0, g], layout=_ROW)  # bf16 [bn]
            z = plgpu.load(sz_smem.at[1, g], layout=_ROW)
            if dequant == "ptx":
              w = _dequant_ptx(w, z + jnp.bfloat16(136), s, block_n)  # bf16 [bn, G]: the dequantized W^T tile
            else:
              if a_from_smem:  # interpret mode: a real relayout; lhs comes with its columns in K_ORDER
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA)
              else:
                w = as_wgmma_operand(w, block_n)
              bcast = lambda v: plgpu.layout_cast(jax.lax.broadcast_in_dim(v, (block_n, _G), (0,)),
                                                  plgpu.Layout.WGMMA)
              w = (w.astype(jnp.bfloat16) - bcast(z)) * bcast(s)  # bf16 [bn, G]: the dequantized W^T tile
            if a_from_smem:
              a_smem[...] = w
              plgpu.commit_smem()
              plgpu.wgmma(acc_ref, a_smem, x_smem.at[:, ks].T)
              plgpu.wgmma_wait(0)
            else:
              plgpu.wgmma(acc_ref, w, x_smem.at[:, ks].T)
          # The decode of group c + 1 overlaps the wgmma of group c. The next step's decode reuses the registers of
          # this step's operands (same loop body), so all wgmmas finish here: wgmma_wait(1) across steps gave
          # wrong results on the H200.
          plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step, grid=(n_groups * _G // block_k,), max_concurrent_steps=steps,
            in_specs=[plgpu.BlockSpec((block_n, block_k), lambda k: (j, k), transforms=swizzled(jnp.int4)),
                      plgpu.BlockSpec((window, block_k), lambda k: (0, k), transforms=swizzled(jnp.bfloat16))],
        )(q_ref.at[expert], lhs_ref.at[pl.ds(loaded, window)])
        plgpu.wgmma_wait(0)
      return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, window)))  # float32 [bn, W]
    o_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)  # o_smem [R + 8, bn]: out rows
    plgpu.commit_smem()
    # TMA boxes are static: store `count` rows starting at row first - loaded of o_smem as a ladder of
    # power-of-two row counts (the bits of count).
    start = first - loaded
    size = 1 << int(math.log2(block_r))
    done = jnp.int32(0)
    while size:
      @pl.when((count & size) != 0)
      def _store(size=size, done=done):
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start + done, size)], out_ref.at[pl.ds(first + done, size), nt])
      done = done + (count & size)
      size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


_STATIC = ("block_n", "block_k", "block_r", "max_concurrent_steps", "interpret", "dequant")
DEQUANTS = ("ptx", "jnp")


def check_inputs(lhs: jax.Array, weights: MgpuInt4Weights, dequant: str, interpret, block_r: int | None,
                 group_sizes: jax.Array):
  """Validates the common arguments of the Mosaic int4 kernels. Returns (dequant, block_r, (M, Kp, E, N)): "jnp" in
  interpret mode (the interpreter runs no inline PTX) and block_r defaulted to 8 up to 8 rows per expert, else 16.
  group_sizes must be integer [E] (another length streamed the wrong expert's weights, floats were truncated)."""
  if dequant not in DEQUANTS:
    raise ValueError(f"dequant={dequant!r} must be one of {DEQUANTS}")
  if not isinstance(weights, (MgpuInt4Weights, MgpuInt4WeightsShift)):
    raise TypeError(f"weights must come from to_mgpu_layout, got {type(weights).__name__}")
  m, kp = lhs.shape
  e, n, kq = weights.q.shape
  if lhs.dtype != jnp.bfloat16:
    raise TypeError(f"lhs must be bfloat16, got {lhs.dtype}")
  if kq != kp:
    raise ValueError(f"lhs has K={kp} but the int4 weights hold Kp={kq}; pad lhs with zeros to Kp")
  if kp % _G:
    raise ValueError(f"Kp={kp} must be a multiple of {_G}")
  ragged_tiles.check_grouped_args(group_sizes, None, e, kp, "weights")
  block_r = block_r or (8 if m <= 8 * e else 16)
  if block_r not in (8, 16):
    raise ValueError(f"block_r={block_r} must be 8 or 16")
  return ("jnp" if interpret else dequant), block_r, (m, kp, e, n)


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=_STATIC)
def int4_grouped_matmul_mgpu(lhs: jax.Array, weights: MgpuInt4Weights, group_sizes: jax.Array, *,
                             block_n: int = 64, block_k: int | None = None, block_r: int | None = None,
                             max_concurrent_steps: int | None = None,
                             interpret: bool | plgpu.InterpretGPUParams = False,
                             dequant: str = "ptx") -> jax.Array:
  """lhs bf16 [M, Kp] (rows sorted by expert) @ int4 W [E, Kp, N] per group_sizes int32 [E] -> float32 [M, N].

  Args:
    lhs: bf16 [M, Kp], Kp = the weights' padded K.
    weights: `to_mgpu_layout` of the quantized weight.
    group_sizes: int32 [E], rows per expert; rows past their sum come back zero.
    block_n: output columns per program (a multiple of 64 dividing N).
    block_k: K per pipeline step (a multiple of 128 dividing Kp); default 512 with 8-row tiles and Kp >= 4096,
      else 256 (the faster of the two at each decode shape of the H200 runs).
    block_r: rows per tile (8 or 16; default 8 up to 8 rows per expert on average).
    max_concurrent_steps: depth of the TMA ring; default 3 for block_k 512, else 4.
    interpret: run in Mosaic GPU's CPU interpreter (True, or its `InterpretGPUParams`, e.g. with detect_races).
    dequant: "jnp" (Mosaic's int4 -> bf16 cast, then (w - z') * s) or "ptx" (one inline-PTX sequence per 2 weights;
      GPU only: interpret mode uses "jnp").
  """
  dequant, block_r, (m, kp, e, n) = check_inputs(lhs, weights, dequant, interpret, block_r, group_sizes)
  if nibble_order(weights) != "prmt":
    raise TypeError("int4_grouped_matmul_mgpu reads the prmt nibble order (MgpuInt4Weights); the shift order is for "
                    "int4_grouped_matmul_mgpu_ws")
  if block_k is None:
    block_k = 512 if block_r == 8 and kp >= 4096 and kp % 512 == 0 else 256
    block_k = block_k if kp % block_k == 0 else _G
  max_concurrent_steps = max_concurrent_steps or (3 if block_k >= 512 else 4)
  if block_n % 64 or n % block_n or block_k % _G or kp % block_k:
    raise ValueError(f"block_n={block_n} must be a multiple of 64 dividing N={n} and block_k={block_k} a multiple "
                     f"of {_G} dividing Kp={kp}")
  pad = max(block_r + 8 - m, -m % 8)  # TMA reads lhs in 8-row tiles and windows of R + 8 rows
  lhs_p = jnp.pad(lhs, ((0, pad), (0, 0))) if pad else lhs
  if interpret:  # the interpreter's relayout keeps the stored K order: feed lhs in that order too
    lhs_p = lhs_p.reshape(m + pad, -1, 32)[..., K_ORDER].reshape(m + pad, kp)
  tiles = row_tiles(group_sizes, m, block_r, m + pad)
  n_groups = kp // _G
  body = functools.partial(_kernel, block_n=block_n, block_k=block_k, block_r=block_r, n_experts=e,
                           n_groups=n_groups, steps=max_concurrent_steps, a_from_smem=interpret, dequant=dequant)
  scratch = dict(
      sz_smem=plgpu.SMEM((2, n_groups, block_n), jnp.bfloat16),
      o_smem=plgpu.SMEM((block_r + 8, block_n), jnp.float32),
      a_smem=(plgpu.SMEM((block_n, _G), jnp.bfloat16, transforms=swizzled(jnp.bfloat16))
              if interpret else plgpu.SMEM((8, 8), jnp.bfloat16)),  # unused on the GPU
      bar=plgpu.Barrier(num_arrivals=1, num_barriers=2))
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m + pad, n), jnp.float32), grid=(tiles.shape[0], n // block_n),
      grid_names=("t", "n"), scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **({"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}
         if interpret else {}))
  out = kernel(tiles, lhs_p, weights.q, weights.scale, weights.zero)
  return out[:m] if pad else out


def mgpu_groups(weights: MgpuInt4Weights | MgpuInt4WeightsShift):
  """Either Mosaic layout -> (c, s, z'): the codes c = q - 8 back in K order, float32 [E, N, Kg, G], and each K
  group's scale s and zero point z' = z - 8, float32 [E, N, Kg, 1]."""
  e, n, kp = weights.q.shape
  c = weights.q.astype(jnp.float32).reshape(e, n, -1, 32)[..., np.argsort(NIBBLE_ORDERS[nibble_order(weights)])]
  group = lambda v: jnp.moveaxis(v.astype(jnp.float32), 1, 2)[..., None]
  return c.reshape(e, n, kp // _G, _G), group(weights.scale), group(weights.zero)


def ungroup(w: jax.Array) -> jax.Array:
  """[E, N, Kg, G] -> [E, Kp, N], the grouped matmul's weight."""
  e, n, kg, g = w.shape
  return jnp.moveaxis(w.reshape(e, n, kg * g), 1, 2)


@jax.jit
def dequantize_mgpu(weights: MgpuInt4Weights | MgpuInt4WeightsShift) -> jax.Array:
  """The weight of either Mosaic layout, float32 [E, Kp, N] = (c - z') · s (exact: small integers times bf16;
  jitted)."""
  c, s, z = mgpu_groups(weights)
  return ungroup((c - z) * s)


@jax.jit
def int4_grouped_matmul_mgpu_reference(lhs: jax.Array, weights: MgpuInt4Weights | MgpuInt4WeightsShift,
                                       group_sizes: jax.Array) -> jax.Array:
  """XLA reference: dequantize to bf16, then `jax.lax.ragged_dot` with float32 accumulation -> float32 [M, N]
  (jitted)."""
  w = dequantize_mgpu(weights).astype(lhs.dtype)  # [E, Kp, N]
  return jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)
