"""Grouped (ragged) vq2 matmul in Mosaic GPU: the warp-specialized int4 kernel's pipeline with codebook look-ups
from a bank-replicated shared-memory codebook instead of the int4 decode.

Same contract as `vq2_grouped_matmul` (read its docstring for the format): out[m] = lhs[m] @ W[e(m)] for the rows m of
expert e (rows sorted by expert), rows past sum(group_sizes) zero, with

  W[e, g·128 + r + 32·j, n] = s[e, g, n] · C[c(e), idx[e, g·32 + r, n], j]     (j = 0..3, r < 32),

an 8-bit index per 4 weights into 256 bf16 4-vectors per expert (c(e) = e) or per layer (c(e) = 0). Only dense
weights with K groups of 128 and no activation scale take this kernel.

Layout (`to_mgpu_layout`, converted once from `VQ2Weights`, same bytes per weight plus 32 KB per codebook):
  `idx` int32 [E, N/16, Kg, 128]: per block of 16 columns and K group, the 512 bytes that the 32 lanes of the warp
    owning those columns read, lane by lane (16 bytes each, one `ld.shared.v4`: no bank conflict). A lane l = 4q + t
    of wgmma's operand layout holds, for rows q and q + 8 of the block, the K pairs (8c + 2t, 8c + 2t + 1) of the 16
    column blocks c: coordinate j = c // 4 of vectors r and r + 1 with r = 8(c % 4) + 2t, 8 vectors per row. Its
    word 2h + w (word 16q + 4t + 2h + w of the 128; row q + 8h) holds in byte b the index of vector
    r = 8(2w + b // 2) + 2t + b % 2.
  `codebook` uint32 [Cb, 64, 128]: per codebook 256 entries × 16 copies × 2 words (bf16 pairs (v0, v1), (v2, v3)),
    entry e's copy l at word 32e + 2l. Lane l of a warp reads copy l mod 16: a half-warp's 8-byte look-ups then fall
    in 16 distinct bank pairs whatever the indices (a single copy gives ~3.5-way conflicts on random indices).
  `scale` bf16 [E, Kg, N].

Per K group a compute warpgroup's lane loads its 16 bytes of index words, looks up 8 vectors per row (one 8-byte
shared load each, inline `ld.shared.v2.b32`), combines the two vectors of a pair with a prmt per register, and
issues the wgmma with the unscaled codewords as the A operand (exact bf16); the group's scale multiplies that
group's float32 accumulator ("acc_scale" of the int4 kernel), so the result is float32 dequantization's. The
pipeline, work table, row tiles, persistence and stores are the int4 kernel's (`int4_grouped_matmul_mgpu_ws`; the
shared pieces in `ws_pipeline.py`).
Defaults: C = 4 compute warpgroups where 256 divides N, block_k 256.

The codebook sits in shared memory once per CTA (a per-layer codebook, loaded before the first item) or per work
item (per-expert codebooks): at an item whose codebook differs from the previous item's, each compute warpgroup
arrives at a barrier once it no longer reads the old one, the first waits for all of them and issues the TMA copy of
the new one (32 KB, from L2 after the first CTA), and all wait for it.

Measured on the H200 (jax 0.11.2, CUPTI, L2 flushed; every expert active, <= 16 rows each, per-expert codebooks):
2.70-3.58x the best bf16 peer (XLA `ragged_dot`, Mosaic `ragged_dot_mgpu`) at 35-45% of copy bandwidth on its bytes
(results/vq2_mgpu_index.md: the prmt index extraction, 1-8% faster than the shift form's 2.62-3.30x in the same
call). With the shift form over the issue's grid (results/vq2_mgpu_grid.md): 2.63-3.37x, 2.75-3.56x with one
codebook per layer, where the Triton vq2 kernel is 0.38-0.48x; about the WS int4 kernel's time (2.67-3.16x in the
same run) on half its bytes. Where the time goes (shift form; results/vq2_mgpu_split.md, _split768.md): without the
codebook's shared loads (`ablate="no_lookup"`) the kernel's time changes by -3 to +1%, so the look-ups'
shared-memory traffic is not the bound; the decode's instructions (address arithmetic and prmts, ~97 per lane and 64
weights with the shift form, ~81 with prmt: ~21 / ~18 us of issue at 8 x 4096->14336) cost 0.024-0.029 ms at the
4096-K shapes; with a constant operand (`"no_decode"`) the kernel is 3.8-5.1x, the memory side alone
(`"no_compute"`) 5.2-6.7x, so no cheaper decode reaches 5x at the Mixtral and Qwen3 shapes. Tried and not kept
(results/vq2_mgpu_orders.md, _cfg14336.md, _cfg2048.md): a K order whose vectors are the thread's own register
pairs (no prmt; lhs's columns permuted per K group instead), from 7% faster to 10% slower, no consistent gain;
look-ups through an LLVM load at a GEP of the codebook's pointer, up to 14% slower; C = 3 (block_k 256 or 512),
0.5-21% slower than C = 4 with block_k 256.

CPU interpret mode (`interpret=True`) runs the same pipeline in Mosaic GPU's interpreter with the look-ups in jnp
(a gather from the loaded codebook) and the decoded tile passed to the wgmma through shared memory.
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

from pallas_kernels import int4_grouped_matmul_mgpu as mg
from pallas_kernels import int4_grouped_matmul_mgpu_ws as ws4
from pallas_kernels import int4_ws_work_table as wt
from pallas_kernels import ragged_tiles
from pallas_kernels import vq2_grouped_matmul as v2
from pallas_kernels import ws_pipeline as wp
from pallas_kernels.interpret_settle import settled_when_interpreted

_G = 128  # K group of the scale: one wgmma K extent of the decoded tile
_Q = _G // 4  # vectors per column and K group
_WG_N = 64
_COPIES = 16  # codebook copies: one per lane of a half-warp
_CB_SHAPE = (64, 128)  # uint32 words of one replicated codebook (256 · 16 · 2), as a TMA box
_ROW = plgpu.Layout.WGMMA.reduce(1)


class MgpuVQ2Weights(NamedTuple):
  """One vq2 expert weight [E, K, N] in this kernel's layout (module docstring)."""
  idx: jax.Array  # int32 [E, N/16, Kg, 128]
  codebook: jax.Array  # uint32 [Cb, 64, 128], Cb = 1 or E
  scale: jax.Array  # bf16 [E, Kg, N]


@functools.partial(jax.jit, static_argnames=("group_size",))
def to_mgpu_layout(ws: v2.VQ2Weights, *, group_size: int = _G) -> MgpuVQ2Weights:
  """`VQ2Weights` (K groups of 128, no activation scale) -> `MgpuVQ2Weights`, the same values (jitted: one program
  per shape)."""
  if group_size != _G:
    raise ValueError(f"group_size={group_size} must be {_G} for the Mosaic GPU vq2 kernel")
  if ws.in_scale is not None:
    raise ValueError("the Mosaic GPU vq2 kernel takes weights without an activation scale (in_scale)")
  e, rows, n = ws.idx.shape
  if n % 16:
    raise ValueError(f"N={n} must be a multiple of 16")
  kg = rows // _Q
  # column n = 16 blk + 8 h + q; word w of row half h, byte b = 2 bh + p: r = 8 (2w + bh) + 2t + p
  idx = ws.idx.astype(jnp.uint32).reshape(e, kg, 2, 2, 4, 2, n // 16, 2, 8)  # [E, Kg, w, bh, t, p, blk, h, q]
  idx = jnp.transpose(idx, (0, 6, 1, 8, 4, 7, 2, 3, 5)).reshape(e, n // 16, kg, 128, 4)  # [.., (q t h w), b]
  words = sum(idx[..., b] << (8 * b) for b in range(4))
  words = jax.lax.bitcast_convert_type(words, jnp.int32)
  cb = jnp.swapaxes(ws.codebook, 1, 2)  # uint32 [Cb, 256, 2]
  cb = jnp.broadcast_to(cb[:, :, None, :], (cb.shape[0], 256, _COPIES, 2)).reshape(cb.shape[0], *_CB_SHAPE)
  return MgpuVQ2Weights(words, cb, ws.scale.astype(jnp.bfloat16))


@jax.jit
def dequantize_mgpu(ws: MgpuVQ2Weights) -> jax.Array:
  """float32 [E, Kp, N], read from this layout alone (the kernel's values: codeword · scale, exact in float32;
  jitted)."""
  e, nb, kg, _ = ws.idx.shape
  n = nb * 16
  r_idx = _vector_indices(ws.idx.reshape(e, nb, kg, 8, 4, 2, 2))  # [E, N/16, Kg, q, h, 32]
  r_idx = jnp.swapaxes(r_idx, 2, 4).reshape(e, n, kg, _Q)  # [E, N, Kg, 32]
  cb = ws.codebook.reshape(-1, 256, _COPIES, 2)[:, :, 0, :]  # uint32 [Cb, 256, 2]
  cb = v2.unpack_codebook(jnp.swapaxes(cb, 1, 2))  # float32 [Cb, 256, 4]
  cb = jnp.broadcast_to(cb, (e, 256, 4))
  vec = jax.vmap(lambda c, i: c[i])(cb, r_idx)  # [E, N, Kg, 32, 4]
  w = jnp.swapaxes(vec, -1, -2).reshape(e, n, kg, _G)  # k = r + 32 j
  w = w * ws.scale.astype(jnp.float32).transpose(0, 2, 1)[..., None]
  return jnp.swapaxes(w.reshape(e, n, kg * _G), 1, 2)


@jax.jit
def vq2_grouped_matmul_mgpu_ws_reference(lhs: jax.Array, weights: MgpuVQ2Weights,
                                          group_sizes: jax.Array) -> jax.Array:
  """XLA reference: float32 dequantization, then `jax.lax.ragged_dot` at HIGHEST precision -> float32 [M, N]
  (jitted)."""
  return jax.lax.ragged_dot(lhs.astype(jnp.float32), dequantize_mgpu(weights), group_sizes,
                            preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def _vector_indices(words):
  """int32 [..., q, t, h, w] index words -> int32 [..., q, h, 32] the vector index of each r (module docstring)."""
  words = jax.lax.bitcast_convert_type(words, jnp.uint32)
  b = jnp.stack([(words >> (8 * k)) & 0xFF for k in range(4)], axis=-1)  # [..., q, t, h, w, b]
  b = b.reshape(*b.shape[:-1], 2, 2)  # [..., q, t, h, w, bh, p]
  b = jnp.moveaxis(b, b.ndim - 5, b.ndim - 2)  # [..., q, h, w, bh, t, p]: r = 8 (2w + bh) + 2t + p
  return b.reshape(*b.shape[:-4], _Q).astype(jnp.int32)


# The two vectors of a pair (r, r + 1) -> the thread's 4 wgmma registers of column blocks c0, c0 + 4, c0 + 8, c0 + 12:
# coordinate j of both, r's in the low half. a0 = (v0, v1), a1 = (v2, v3) of r; b0, b1 of r + 1.
_SELECT = (0x5410, 0x7632)  # prmt: low halves of a and b / high halves


def _lookup_registers(i_smem, cb_ref, group: int, *, no_lookup: bool, index_extract: str):
  """K group `group` of the step's index tile (int32 [bn/16, gk, 128] in shared memory) and the replicated codebook
  -> bf16 [64, 128] wgmma operand of this warpgroup (the codewords, unscaled): one 16-byte shared load of the lane's
  index words; per vector a zero-filling prmt that takes the index byte, a shift by 7 and an add (one `lea` after
  ptxas) and one 8-byte shared load (inline `ld.shared.v2.b32` at a 32-bit address); a prmt per register.
  index_extract "shift" takes the byte by a shift and an and instead (3 instructions per vector before the load,
  1-8% slower on the H200: results/vq2_mgpu_index.md).
  no_lookup (timing only): the 8-byte load is left out and the masked index word stands in for both codeword
  registers (wrong values; the index loads, the address arithmetic, the prmts and the wgmmas stay)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((_WG_N, _G), jnp.bfloat16, plgpu.Layout.WGMMA))
  def lookup(_, idx, cb):
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    c = lambda v: mgpu.utils.c(v, i32)
    smem_ptr = lambda addr: llvm.inttoptr(llvm.PointerType.get(3), addr)
    gk = ir.MemRefType(idx.type).shape[1]
    tid = mgpu.utils.thread_idx()  # warp (tid / 32) of the CTA: block of 16 columns tid / 32 of the N tile
    idx_addr = arith.addi(llvm.ptrtoint(i32, mgpu.utils.memref_ptr(idx)),
                          arith.addi(arith.muli(arith.shrui(tid, c(5)), c(gk * 512)),
                                     arith.addi(c(group * 512), arith.shli(arith.andi(tid, c(31)), c(4)))))
    v4i32 = ir.VectorType.get((4,), i32)
    lane_words = llvm.load(v4i32, smem_ptr(idx_addr))  # words 2h + w
    cb_ptr = mgpu.utils.memref_ptr(cb)
    lane_off = arith.shli(arith.andi(tid, c(_COPIES - 1)), c(3))  # 8 · (lane mod 16)
    base_lane = arith.addi(llvm.ptrtoint(i32, cb_ptr), lane_off)
    pair_ty = llvm.StructType.get_literal([i32, i32])
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((_WG_N, _G)), dtype=object)  # [1, 16, 1, 1, 2, 1, 1, 1, 1]

    def fetch(word, byte):
      # entry · 16 copies · 8 bytes: the byte moved to bits 7-14. A 32-bit shared address: an LLVM load at a GEP of
      # the codebook's pointer ran up to 14% slower at 8 × 4096→14336 (results/vq2_mgpu_cfg14336.md). The asm has
      # side effects so that LLVM keeps it after the barrier waits (ptxas still schedules it).
      if index_extract == "prmt":  # bytes 1-3 of the result from byte 4 of the pair (word, 0): zero
        index = llvm.inline_asm(i32, [word, c(0)], f"prmt.b32 $0, $1, $2, {0x4440 + byte:#x};", "=r,r,r")
        addr = arith.addi(base_lane, arith.shli(index, c(7)))
      else:
        moved = arith.shli(word, c(7)) if byte == 0 else arith.shrui(word, c(8 * byte - 7))
        addr = arith.addi(base_lane, arith.andi(moved, c(0xFF << 7)))
      if no_lookup:
        return addr, arith.xori(addr, word)
      pair = llvm.inline_asm(pair_ty, [addr], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r", has_side_effects=True)
      return llvm.extractvalue(i32, pair, [0]), llvm.extractvalue(i32, pair, [1])

    for half in range(2):  # the lane's rows q and q + 8
      for w in range(2):
        word = llvm.extractelement(lane_words, arith.constant(i64, 2 * half + w))
        for bh in range(2):  # vectors r = 8 c0 + 2t (byte 2 bh) and r + 1 (byte 2 bh + 1)
          c0 = 2 * w + bh
          a, b = fetch(word, 2 * bh), fetch(word, 2 * bh + 1)
          for j in range(4):
            out = llvm.inline_asm(i32, [a[j // 2], b[j // 2]], f"prmt.b32 $0, $1, $2, {_SELECT[j % 2]:#x};",
                                  "=r,r,r")
            regs[(0, c0 + 4 * j, 0, 0, half, 0, 0, 0, 0)] = mgpu.utils.bitcast(out, bf16x2)
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
  return lookup(i_smem, cb_ref)


def _lookup_jnp(words, cb_words):
  """Interpret mode's equivalent of `_lookup_registers`: int32 [4, 128] index words of the warpgroup's 4 column
  blocks and uint32 [64, 128] codebook -> bf16 [64, 128] codewords in K order."""
  r_idx = _vector_indices(words.reshape(4, 8, 4, 2, 2))  # [4, q, h, 32]
  r_idx = jnp.swapaxes(r_idx, 1, 2).reshape(_WG_N, _Q)  # row 16 blk + 8 h + q
  cb = cb_words.reshape(256, _COPIES, 2)[:, 0, :]  # [256, 2]
  cb = v2.unpack_codebook(cb.T[None])[0]  # float32 [256, 4]
  vec = cb[r_idx]  # [64, 32 (r), 4 (j)]
  return jnp.swapaxes(vec, 1, 2).reshape(_WG_N, _G).astype(jnp.bfloat16)  # k = r + 32 j


def _kernel(table_ref, lhs_ref, idx_ref, cb_ref, scale_ref, out_ref, o_smem, a_smem, cb_smem, cb_ready, cb_free, *,
            n_wgs: int, block_k: int, block_r: int, window: int, n_groups: int, n_cols: int, steps: int,
            memory_registers: int, compute_registers: int, interpret: bool, per_expert: bool, ablate: str,
            index_extract: str):
  # table_ref: int32 [C_ctas, I, 8] (work_table); lhs_ref: bf16 [M', Kp]; idx_ref: int32 [E, N/16, Kg, 128]; cb_ref:
  # uint32 [Cb, 64, 128]; scale_ref: bf16 [E, Kg, N]; out_ref: float32 [M', N]. o_smem: float32 [n_wgs, W, 64];
  # a_smem: bf16 [n_wgs, 64, G] (interpret mode); cb_smem: uint32 [64, 128]; cb_ready: TMA barrier; cb_free:
  # barrier of n_wgs arrivals.
  cta, wg = jax.lax.axis_index("c"), jax.lax.axis_index("wg")
  bn = n_wgs * _WG_N
  gk = block_k // _G
  ksteps = n_groups // gk
  wg_rows = pl.ds(pl.multiple_of(jnp.minimum(wg, n_wgs - 1) * _WG_N, _WG_N), _WG_N)

  def decode(i_smem, c):
    if ablate == "no_decode":  # timing only: no index loads or look-ups; every codeword 1
      return plgpu.layout_cast(jnp.full((_WG_N, _G), 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)
    if interpret:
      return _lookup_jnp(i_smem[pl.ds(jnp.minimum(wg, n_wgs - 1) * 4, 4), c], cb_smem[...])
    return _lookup_registers(i_smem, cb_smem, c, no_lookup=ablate == "no_lookup", index_extract=index_extract)

  def body(_, i_smem, x_smem, s_smem, acc):
    # i_smem: int32 [bn / 16, block_k / G, 128]; x_smem: bf16 [W, block_k]; s_smem: bf16 [block_k / G, bn];
    # acc: float32 [64, W], out^T of this warpgroup's columns.
    if ablate == "no_compute":
      return acc
    scales = [plgpu.load(s_smem.at[c, wg_rows], layout=_ROW) for c in range(gk)]  # read before the wgmmas

    def groups(*tmps):
      for c in range(gk):
        wp.group_wgmma(tmps[c], decode(i_smem, c), x_smem, c, a_smem.at[wg] if interpret else None)
      out = acc
      for c in range(gk):  # reading an accumulator waits for the wgmmas
        s = plgpu.layout_cast(jax.lax.broadcast_in_dim(scales[c].astype(jnp.float32), (_WG_N, window), (0,)),
                              plgpu.Layout.WGMMA)
        out = out + tmps[c][...] * s
      return out
    return pl.run_scoped(groups, *[plgpu.ACC((_WG_N, window))] * gk)

  specs = [plgpu.BlockSpec((bn // 16, gk, 4 * _Q), lambda k: (0, k, 0)),
           plgpu.BlockSpec((window, block_k), lambda k: (0, k), transforms=mg.swizzled(jnp.bfloat16)),
           plgpu.BlockSpec((gk, bn), lambda k: (k, 0))]

  def make_pipeline(compute_context, state):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(ksteps,), memory_registers=memory_registers, in_specs=specs, max_concurrent_steps=steps,
        wg_axis="wg", num_compute_wgs=n_wgs, compute_context=compute_context, pipeline_state=state)

  def gmem(expert, loaded, col0):
    cols = pl.ds(col0, bn)
    blocks = pl.ds(col0 // 16, bn // 16)
    return (idx_ref.at[expert, blocks], lhs_ref.at[pl.ds(loaded, window)], scale_ref.at[expert, :, cols])

  ignore = lambda *_, **__: None
  allocs = make_pipeline(ignore, None).get_allocations(*gmem(0, 0, 0))

  def scope(allocs):
    n_items = wp.item_count(table_ref, cta)

    @pl.loop(0, n_items)
    def _item(i):
      expert, loaded, first, count, virtual, col0, owner = wp.read_item(table_ref, cta, i, wg, bn, n_cols)
      book = expert if per_expert else 0
      prev_book = table_ref[cta, jnp.maximum(i - 1, 0), 0] if per_expert else 0
      new_book = (i == 0) | (book != prev_book)

      def compute_context(run):
        @pl.when(new_book & (ablate != "no_compute"))
        def _codebook():  # every warpgroup is past its reads of the previous codebook; the first loads the new one
          plgpu.barrier_arrive(cb_free)

          @pl.when(wg == 0)
          def _load():
            plgpu.barrier_wait(cb_free)
            plgpu.copy_gmem_to_smem(cb_ref.at[book], cb_smem, cb_ready)
          plgpu.barrier_wait(cb_ready)

        acc = run(plgpu.layout_cast(jnp.zeros((_WG_N, window), jnp.float32), plgpu.Layout.WGMMA))
        wp.store_item(acc, o_smem, out_ref, wg=wg, col0=col0, first=first, loaded=loaded, count=count,
                       virtual=virtual, owner=owner, block_r=block_r, window=window)

      def run(state):
        make_pipeline(compute_context, state)(*gmem(expert, loaded, col0), allocations=allocs)
      wp.run_chained(i, n_items, run, compute_registers)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scope, allocs, collective_axes="wg")


# The tiling options a caller may fix per weight (`quant.to_mgpu_layout(model, block_r=...)` stores them); checked by
# `int4_grouped_matmul_mgpu_ws.check_options`.
OPTIONS = ("block_r", "num_compute_wgs", "block_k", "table_impl")


def default_compute_wgs(m: int, n_experts: int, n: int, block_r: int, num_ctas: int) -> int:
  """C = 4 where 256 divides N (the most compute warps per SM to hide the look-ups' latency: at 8 × 4096→14336 ×
  16 / 128 rows 0.0734 / 0.0830 ms against C = 3's 0.0886 / 0.0836 with block_k 256, results/vq2_mgpu_cfg14336.md),
  else the int4 kernel's rule."""
  if n % (4 * _WG_N) == 0:
    return 4
  return ws4.default_compute_wgs(m, n_experts, n, block_r, num_ctas)
ABLATIONS = ("", "no_compute", "no_decode", "no_lookup")
INDEX_EXTRACTS = ("shift", "prmt")
_STATIC = ("num_compute_wgs", "block_k", "block_r", "max_concurrent_steps", "memory_registers", "compute_registers",
           "num_ctas", "interpret", "ablate", "table_impl", "index_extract")


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=_STATIC)
def vq2_grouped_matmul_mgpu_ws(lhs: jax.Array, weights: MgpuVQ2Weights, group_sizes: jax.Array, *,
                               num_compute_wgs: int | None = None, block_k: int | None = None,
                               block_r: int | None = None, max_concurrent_steps: int | None = None,
                               memory_registers: int | None = None, compute_registers: int | None = None,
                               num_ctas: int | None = None, interpret: bool | plgpu.InterpretGPUParams = False,
                               ablate: str = "", table_impl: str = "pallas", index_extract: str = "prmt") -> jax.Array:
  """lhs bf16 [M, Kp] (rows sorted by expert) @ vq2 W [E, Kp, N] per group_sizes int32 [E] -> float32 [M, N].

  Args:
    lhs: bf16 [M, Kp], Kp = the weights' padded K (a multiple of 128).
    weights: `to_mgpu_layout` of a `VQ2Weights`.
    group_sizes: int32 [E], rows per expert; rows past their sum come back zero.
    num_compute_wgs, block_r, max_concurrent_steps, memory_registers, compute_registers, num_ctas, table_impl: as in
      `int4_grouped_matmul_mgpu_ws` (the same defaults for C and R; aligned row tiles).
    block_k: K per pipeline step (a multiple of 128 dividing Kp); default 512 where it divides Kp (a step reads half
      the int4 kernel's weight bytes per K), else 256, else 128.
    interpret: run in Mosaic GPU's CPU interpreter (True, or its `InterpretGPUParams`).
    ablate: timing only (wrong results): "no_compute" streams the tiles through the ring and skips the codebook,
      look-ups and wgmmas (the memory-side ceiling); "no_decode" keeps the codebook loads, the wgmmas, the scaling and
      the stores but gives every wgmma a constant operand (no index loads or look-ups); "no_lookup" (GPU only) keeps
      everything but the codebook's shared loads (their addresses stand in for the codewords). With the kernel they
      split the compute's time over the stream into look-ups, the rest of the decode, and the wgmmas and epilogue.
    index_extract: how the GPU path takes a vector's index byte from its word: "prmt" (one zero-filling prmt, the
      default) or "shift" (a shift and an and: one instruction more per vector, 1-8% slower on the H200 over the
      issue's grid, results/vq2_mgpu_index.md). Interpret mode runs the look-ups in jnp either way.
  """
  if not isinstance(weights, MgpuVQ2Weights):
    raise TypeError(f"weights must come from to_mgpu_layout, got {type(weights).__name__}")
  m, kp = lhs.shape
  e, nb, kg, _ = weights.idx.shape
  n = nb * 16
  if lhs.dtype != jnp.bfloat16:
    raise TypeError(f"lhs must be bfloat16, got {lhs.dtype}")
  if kg * _G != kp:
    raise ValueError(f"lhs has K={kp} but the vq2 weights hold Kp={kg * _G}; pad lhs with zeros to Kp")
  if kp % _G:
    raise ValueError(f"Kp={kp} must be a multiple of {_G}")
  if n % _WG_N:
    raise ValueError(f"N={n} must be a multiple of {_WG_N}")
  if weights.codebook.shape[0] not in (1, e) or weights.codebook.shape[1:] != _CB_SHAPE:
    raise ValueError(f"codebook shape {weights.codebook.shape} must be (1 or E={e}, {_CB_SHAPE[0]}, {_CB_SHAPE[1]})")
  if ablate not in ABLATIONS:
    raise ValueError(f"ablate={ablate!r} must be one of {ABLATIONS}")
  if index_extract not in INDEX_EXTRACTS:
    raise ValueError(f"index_extract={index_extract!r} must be one of {INDEX_EXTRACTS}")
  if ablate == "no_lookup" and interpret:
    raise ValueError("ablate='no_lookup' takes the GPU's look-ups; interpret mode runs them in jnp")
  ragged_tiles.check_grouped_args(group_sizes, None, e, kp, "weights")  # integer [E]
  ws4.check_options(kp, n, block_r=block_r, num_compute_wgs=num_compute_wgs, block_k=block_k, table_impl=table_impl)
  block_r = block_r or ws4.default_block_r(m, e, True)
  num_ctas = num_ctas or (4 if interpret else wp.num_sms())
  num_compute_wgs = num_compute_wgs or default_compute_wgs(m, e, n, block_r, num_ctas)
  bn = num_compute_wgs * _WG_N
  block_k = block_k or next(b for b in (256, _G) if kp % b == 0)
  ksteps = kp // block_k
  window = wt.window(block_r, True)
  stage_bytes = bn * block_k // 4 + window * block_k * 2 + (block_k // _G) * bn * 2
  fixed = (num_compute_wgs * window * _WG_N * 4 + math.prod(_CB_SHAPE) * 4 +
           (num_compute_wgs * _WG_N * _G * 2 if interpret else 0))
  max_concurrent_steps = wp.ring_depth(ksteps, stage_bytes, fixed, max_concurrent_steps)
  memory_registers = memory_registers or (32 if num_compute_wgs == 4 else 40)
  compute_registers = wp.register_split(num_compute_wgs, memory_registers, compute_registers)
  pad = wt.loaded_rows(m, block_r, True) - m
  lhs_p = jnp.pad(lhs, ((0, pad), (0, 0))) if pad else lhs
  table = wp.build_work_table(group_sizes, m, m + pad, table_impl=table_impl, interpret=bool(interpret),
                               block_r=block_r, n_tiles=-(-n // bn), n_experts=e, n_ctas=num_ctas, aligned=True)
  body = functools.partial(_kernel, n_wgs=num_compute_wgs, block_k=block_k, block_r=block_r, window=window,
                           n_groups=kp // _G, n_cols=n, steps=max_concurrent_steps, memory_registers=memory_registers,
                           compute_registers=compute_registers, interpret=bool(interpret),
                           per_expert=weights.codebook.shape[0] > 1, ablate=ablate, index_extract=index_extract)
  scratch = dict(
      o_smem=plgpu.SMEM((num_compute_wgs, window, _WG_N), jnp.float32),
      a_smem=(plgpu.SMEM((num_compute_wgs, _WG_N, _G), jnp.bfloat16, transforms=mg.swizzled(jnp.bfloat16))
              if interpret else plgpu.SMEM((8, 8), jnp.bfloat16)),
      cb_smem=plgpu.SMEM(_CB_SHAPE, jnp.uint32),
      cb_ready=plgpu.Barrier(),
      cb_free=plgpu.Barrier(num_arrivals=num_compute_wgs))
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m + pad, n), jnp.float32), grid=(num_ctas,), grid_names=("c",),
      num_threads=num_compute_wgs + 1, thread_name="wg", scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **({"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}
         if interpret else {}))
  out = kernel(table, lhs_p, weights.idx, weights.codebook, weights.scale)
  return out[:m] if pad else out
