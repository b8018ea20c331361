"""The fused OS-KVP decode core (uniform codebooks) on warp-level tensor-core instructions (`mma.sync`), Mosaic GPU.

The same inputs, arithmetic and outputs as `oskvp_decode_core_mgpu.decode_core_mgpu` (2-bit key and value codes,
fp8 outlier channels, ragged lengths), with another division of the work. There one warpgroup scores a 128-token
block with wgmmas, takes the block's maximum across its 4 warps, stores p to shared memory, fences, and sums the
values with wgmmas: two warpgroup barriers and two wgmma waits per block, and on the H200 the kernel's time is that
chain's latency (`benchmarks/notes_mgpu_oskvp.md` §18: the compute side alone takes 95% of the kernel). Here each
warp owns 32 tokens of every 128-token block, as its own split of the sequence, and keeps everything in registers:

  key scores   key_rows="tokens" (the default): S [16 tokens, 8 heads] = kcodes · qd^T per m-tile (2 m-tiles ×
               4 k-steps of m16n8k32 s8: the codes, a plane per shift, are the A operand, the query digits B);
               key_rows="heads": S^T [16 (8 heads used), 8 tokens] = qd · kcodes^T (4 n-tiles × 4 k-steps)
  key outliers += the fp8 channels (m16n8k8 f16 onto the f32 scores; one cvt.rn.f16x2.e4m3x2 per pair)
  softmax      per head over the warp's 32 tokens; the running max changes rarely, so the int32 value sums are
               flushed into f32 sums (in shared memory, scaled by 2^(m_old − m_new)) only when some head's block
               maximum exceeds it (a warp vote); p8 = round(127 · 2^(s − m)) as in the wgmma core
  value sums   O^T [16 channels, 8 heads] += vcodes [16, 32 tokens] · p8^T       (8 m-tiles, m16n8k32 u8: each
               plane masked in place, `value_plane`, its sums 4^p too large until the merge)
  value outl.  O_o^T [16 (8 channels), 8 heads] += vout [16, 16] · p8^T          (2 k-steps, m16n8k16 f16)

The register trick that makes this possible: the value sums' B fragment (thread (g, t) of a warp holds head g,
tokens 4t..4t+3 and 16+4t..16+4t+3) is, with key_rows="heads", exactly the key scores' accumulator fragment (head
g, columns 2t, 2t + 1 of each 8-token n-tile) once the n-tiles' columns are assigned to tokens by `key_token`; with
"tokens" each 8 × 8 block of p goes there by one `movmatrix` transpose. The value codes' token-contiguous bytes are
the A fragment as loaded (4 tokens of one channel per 32-bit word, a plane per shift). No shared-memory round trip
for p, no fence, no cross-warp reduction per block.

Per program (a row of BK, a split) the warps' states are four splits of the sequence (tokens 32w..32w+31 of each
block), merged at the end by log-sum-exp through shared memory into `decode_core_splits`'s outputs (acc in ACC row
order, `acc_row`): `decode_core_mma_splits` drops into the wired path's epilogue, `decode_core_mma` merges the
splits in XLA. `decode_core_mma_reference` is its arithmetic in XLA (32-token blocks in `warp_order`).

GPU only: the kernel is inline Mosaic (`plgpu.inline_mgpu`, PTX from `mma_sync_ptx.py`), which Mosaic's CPU
interpreter does not run. On the CPU, `oskvp_decode_core_mma_model.emulate` runs the same index math (`rg.Ints`) on
the PTX fragment layouts in numpy, and the tests check the lowering. H = 128 (Q = 32 code bytes per token) only.
Measured: `benchmarks/notes_mgpu_oskvp.md` §24.
"""

from __future__ import annotations

import functools

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.lib.mlir.dialects import memref
from jax._src.lib.mlir.dialects import scf
from jax._src.lib.mlir.dialects import vector
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels import mma_sync_ptx as px
from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels import oskvp_value_layout as vl
from pallas_kernels import oskvp_value_sums_mgpu as vs

N = dc.N  # query heads per kv head, padded
OUTLIERS = rg.OUTLIERS
WARPS = 4  # warps per program; each owns WARP_TOKENS of every block
WARP_TOKENS = 32
BLOCK_S = WARPS * WARP_TOKENS  # tokens per pipeline step
Q = 32  # code bytes per token (H = 128)
PLANES = 4  # 2-bit codes per byte
CODE_MAX = 3  # the largest 2-bit code
MASKED = dc.MASKED
P_LEVELS = dc.P_LEVELS
ABLATIONS = ("", "no_compute", "l2_resident")
KEY_ROWS = ("heads", "tokens")
# The default orientation: "tokens" took the compute side alone 6% under "heads" on an H100 (90.7 against 96.9 µs at
# 64k × 8) and the wired form 1% (results/oskvp_decode_core_mma_h100_s41c.md)
KEY_ROW_DEFAULT = "tokens"


# ---- the index math, on Python ints (`rg.Ints`: the CPU model) or i32 values (`rg.Mlir`: the kernel) ----

def key_token(ops, nt: int, n):
  """Column n of the key scores' n-tile nt -> its token among the warp's 32. Thread (g, t) then holds, in columns
  2t, 2t + 1 of n-tiles 0, 1 (2, 3), tokens 4t..4t+3 (16+4t..16+4t+3): the value sums' B fragment."""
  return ops.add(16 * (nt >> 1) + 2 * (nt & 1), ops.add(ops.shl(ops.shr(n, 1), 2), ops.band(n, 1)))


def key_code_source(ops, nt: int, warp, g, t):
  """The key codes thread (warp, g, t) loads for n-tile nt: (row of the [128, Q] tile, first byte); 8 bytes. The
  k-step p's B registers are plane p of the two words: byte i of word j is channel p·Q + 8t + 4j + i."""
  return ops.add(ops.shl(warp, 5), key_token(ops, nt, g)), ops.shl(t, 3)


def value_code_source(ops, half: int, hi_row: int, hi_token: int, warp, g, t):
  """The value-code word of thread (warp, g, t) for m-tile half `half` (channel rows 16·half..), row half hi_row
  (rows g or 8 + g) and token half hi_token (tokens 4t.. or 16 + 4t..): (byte row of the [Q, 128] tile, first
  token); 4 bytes = 4 tokens; plane p of it is channel p·Q + byte row."""
  return ops.add(16 * half + 8 * hi_row, g), ops.add(ops.shl(warp, 5), ops.add(16 * hi_token, ops.shl(t, 2)))


def value_plane(ops, word, p: int):
  """Plane p of a value-code word masked in place: byte i holds code · 4^p (u8, up to 192), one LOP3 per register
  where the shifted plane took a shift and a LOP3 (24 instructions fewer per step). m-tile (p, half)'s sums come out
  4^p times too large; the merge scales them back (`VALUE_PLANE_SCALE`, exact). The int32 sums stay below 2^31 up
  to MAX_SPLIT_TOKENS tokens per program (127 · 192 per token and accumulator, a quarter of the tokens per warp)."""
  return ops.band(word, 0x03030303 << (2 * p))


VALUE_PLANE_SCALE = tuple(4.0**-p for p in range(PLANES))
MAX_SPLIT_TOKENS = WARPS * ((1 << 31) // (int(P_LEVELS) * CODE_MAX * 4**(PLANES - 1)))  # 352,276


KO_TOKENS = 8  # key-outlier tokens per row of the TMA tile: kout [S, 8] seen as [S / 8, 64] (64-byte rows)


def key_outlier_source(ops, nt: int, warp, g, t):
  """The key-outlier pair (channels 2t, 2t + 1 of token key_token(nt, g)) in the tile fp8 [16, 64] (eight tokens a
  row): (row, column)."""
  token = ops.add(ops.shl(warp, 5), key_token(ops, nt, g))
  return ops.shr(token, 3), ops.add(ops.shl(ops.band(token, 7), 3), ops.shl(t, 1))


def value_outlier_source(ops, step: int, warp, g, t):
  """The value-outlier word of k-step `step` (channel g, tokens 16·step + 4t..+3) in the tile fp8 [8, 128]."""
  return g, ops.add(ops.shl(warp, 5), ops.add(16 * step, ops.shl(t, 2)))


# ---- references ----

def warp_order(s: int, splits: int) -> np.ndarray:
  """The token permutation that makes each (split, warp) partial's tokens contiguous, in its block order: for
  split sp, warp w, step i: tokens sp·L + 128·i + 32·w + 0..31 (L = S / splits)."""
  steps = s // (splits * BLOCK_S)
  idx = np.arange(s).reshape(splits, steps, WARPS, WARP_TOKENS)
  return idx.transpose(0, 2, 1, 3).reshape(-1)


@functools.partial(jax.jit, static_argnames=("splits",))
def decode_core_mma_reference(kcodes, vcodes, qd, qs, lengths=None, kout=None, vout=None, qo=None, *,
                              splits: int):
  """The kernel's arithmetic in XLA: `dc.decode_core_blockwise_reference` over the 4 · splits partials of 32-token
  blocks (`warp_order`). Same shapes and outputs as `decode_core_mma`."""
  bk, s, _ = kcodes.shape
  pos = jnp.asarray(warp_order(s, splits))
  valid = dc.valid_tokens(bk, s, lengths)[:, :, pos]
  return dc.blockwise_model(kcodes[:, pos], vcodes[:, :, pos], qd, qs, valid,
                            None if kout is None else kout[:, pos], None if vout is None else vout[:, :, pos], qo,
                            block_s=WARP_TOKENS, splits=WARPS * splits)


def tile_offset(ops, row, col, width: int, sw: int):
  """Byte offset of (row, col) in a byte tile [R, width] that TMA stored in tiles of 8 × width rows, swizzled by
  sw bytes (the 16-byte chunk index XOR-ed with address bits 7+ of the row within its tile)."""
  xor = rg.swizzle_chunk_xor(ops, ops.band(row, 7), width, sw)
  return ops.add(ops.mul(row, width), ops.bxor(col, ops.shl(xor, 4)))


def _tiled_word(ref, nbytes: int, row, col, *, width: int, sw: int):
  return px.load(ref, tile_offset(rg.Mlir(), row, col, width, sw), nbytes)


# The carried state of a thread: acc_i int32 [32] (the value sums since the running max last grew: 8 m-tiles × 4),
# misc f32 [8] (the running max: of head g with key_rows="heads", of heads 2t, 2t + 1 with "tokens"; l_f; acc_o of
# heads 2t, 2t + 1), li int32 [4] (l_i), carried as WGMMA-layout arrays of these shapes; and in shared memory af
# f32 [4 warps · 32 · 32 lanes] (the flushed sums, relative to m: touched only when the max grows, so kept out of
# the registers).
ACC_SHAPE = (512, N)
MISC_SHAPE = (128, N)  # 8 values a thread: m_a, m_b, l_f, acc_o (2), unused (3)
LI_SHAPE = (64, N)  # 4 values a thread: l_i, unused (3)


FLUSHED = WARPS * 32 * 32  # f32 words of af


def _flushed_index(warp, lane):
  """Index of the thread's i-th flushed sum in af (lanes contiguous: conflict-free), as a function of i."""
  ops = rg.Mlir()
  base = ops.add(ops.shl(warp, 10), lane)
  return lambda i: arith.index_cast(ir.IndexType.get(), ops.add(base, 32 * i))


def _init_state():
  """Before the pipeline: the thread's 32 flushed sums in af = 0; returns the carried state (acc_i = 0, the running
  maxima MASKED, the sums 0)."""
  wg = plgpu.Layout.WGMMA
  ret = (plgpu.ShapeDtypeStruct(ACC_SHAPE, jnp.int32, wg), plgpu.ShapeDtypeStruct(MISC_SHAPE, jnp.float32, wg),
         plgpu.ShapeDtypeStruct(LI_SHAPE, jnp.int32, wg))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=ret)
  def init(_, af_ref):
    ops, f32 = rg.Mlir(), px.f32()
    warp, lane = rg.thread_coords(ops)
    af_index = _flushed_index(warp, lane)
    zf = mgpu.utils.c(0.0, f32)
    for i in range(32):
      memref.store(zf, af_ref, [af_index(i)])
    masked = mgpu.utils.c(MASKED, f32)
    return (px.fragment([ops.value(0)] * 32, ACC_SHAPE, jnp.int32), px.fragment([masked, masked] + [zf] * 6, MISC_SHAPE,
                                                                             jnp.float32),
            px.fragment([ops.value(0)] * 4, LI_SHAPE, jnp.int32))

  return init


def _step(outliers: bool, ragged: bool, qo_width: int, key_rows: str):
  """One pipeline step of one program: the inline Mosaic function (see `_kernel`). key_rows="heads": the key scores
  as S^T [heads, tokens] (the query digits the A operand; rows 8..15 zero); "tokens": as S [tokens, heads] (the
  codes the A operand, 8 mma.sync instead of 16), p taken to the value operand's layout by 4 `movmatrix`
  transposes."""
  wg = plgpu.Layout.WGMMA
  ref = plgpu.RefType
  arg_types = [ref(ks.swizzled(Q)), ref(ks.swizzled(BLOCK_S)), ref(ks.swizzled(128)), ref(), ref(), wg, wg, wg]
  if outliers:
    arg_types += [ref(), ref(ks.swizzled(BLOCK_S)), ref()]
  if ragged:
    arg_types += [wg]
  ret = (plgpu.ShapeDtypeStruct(ACC_SHAPE, jnp.int32, wg), plgpu.ShapeDtypeStruct(MISC_SHAPE, jnp.float32, wg),
         plgpu.ShapeDtypeStruct(LI_SHAPE, jnp.int32, wg))
  tokens_m = key_rows == "tokens"

  @plgpu.inline_mgpu(arg_types=tuple(arg_types), return_type=ret)
  def step(_, k_ref, v_ref, q_ref, qs_ref, af_ref, acc_i, misc, li, *rest):
    ops, i32, f32, index = rg.Mlir(), px.i32(), px.f32(), ir.IndexType.get()
    ko_ref, vo_ref, qo_ref = rest[:3] if outliers else (None, None, None)
    first = rest[-1] if ragged else None
    warp, lane = rg.thread_coords(ops)
    g, t = ops.shr(lane, 2), ops.band(lane, 3)
    acc_i, misc, li = px.scalars(acc_i), px.scalars(misc), px.scalars(li)
    ms = misc[:2] if tokens_m else misc[:1]  # the running max: heads 2t, 2t + 1 ("tokens") or head g ("heads")
    l_f, acc_o = misc[2], misc[3:5]
    l_i = li[0]
    af_index = _flushed_index(warp, lane)
    zi, zf = ops.value(0), mgpu.utils.c(0.0, f32)
    load_qs = lambda head: memref.load(qs_ref, [arith.index_cast(index, head)])

    # key scores. qd's rows g, channels p·Q + 8t + 0..7 (two words per k-step p): the A fragment ("heads") or the
    # B fragment ("tokens"); the codes of token key_token(nt, g), channels p·Q + 8t + 0..7 likewise.
    qw = [[_tiled_word(q_ref, 4, g, ops.add(p * Q + 4 * j, ops.shl(t, 3)), width=128, sw=128)[0] for j in range(2)]
          for p in range(PLANES)]
    if outliers:
      qo_w, = px.load(qo_ref, ops.add(ops.mul(g, 2 * qo_width), ops.shl(t, 2)), 4)  # qo f16 [8, W]: row g, 2t, 2t + 1
    code_words, outlier_pairs = [], []
    for nt in range(4):
      row, col = key_code_source(ops, nt, warp, g, t)
      code_words.append(_tiled_word(k_ref, 8, row, col, width=Q, sw=Q))
      if outliers:
        orow, ocol = key_outlier_source(ops, nt, warp, g, t)
        pair, = px.load(ko_ref, ops.add(ops.shl(orow, 6), ocol), 2)  # ko fp8 [16, 64]
        outlier_pairs.append(px.e4m3x2(arith.extui(i32, pair)))
    plane = lambda w, p: ops.band(ops.shr(w, 2 * p) if p else w, 0x03030303)
    if tokens_m:
      # S [16 tokens, 8 heads] per m-tile mt: rows g / 8 + g are the tokens of n-tiles 2mt / 2mt + 1, column g
      scores = []  # per m-tile: [s(row g, head 2t), s(g, 2t + 1), s(8 + g, 2t), s(8 + g, 2t + 1)]
      scale = [load_qs(ops.shl(t, 1)), load_qs(ops.add(ops.shl(t, 1), 1))]
      for mt in range(2):
        lo, hi = code_words[2 * mt], code_words[2 * mt + 1]
        c = [zi] * 4
        for p in range(PLANES):
          c = px.mma("m16n8k32", "s8", [plane(lo[0], p), plane(hi[0], p), plane(lo[1], p), plane(hi[1], p)],
                  qw[p], c)
        sc = [arith.mulf(arith.sitofp(f32, c[j]), scale[j % 2]) for j in range(4)]
        if outliers:
          sc = px.mma("m16n8k8", "f16", [outlier_pairs[2 * mt], outlier_pairs[2 * mt + 1]], [qo_w], sc)
        scores.append(sc)
      flat = [x for sc in scores for x in sc]
      token_of = lambda i: key_token(ops, 2 * (i // 4) + (i % 4) // 2, g)  # flat index -> token among the warp's
    else:
      # S^T [16 (8 heads), 8 tokens] per n-tile nt: row g, columns 2t, 2t + 1 = tokens key_token(nt, 2t + e)
      scale = load_qs(g)
      flat = []
      for nt in range(4):
        c = [zi] * 4
        for p in range(PLANES):
          c = px.mma("m16n8k32", "s8", [qw[p][0], zi, qw[p][1], zi], [plane(w, p) for w in code_words[nt]], c)
        sc = [arith.mulf(arith.sitofp(f32, c[e]), scale) for e in range(2)]
        if outliers:
          sc = px.mma("m16n8k8", "f16", [qo_w, zi], [outlier_pairs[nt]], [sc[0], sc[1], zf, zf])[:2]
        flat += sc
      token_of = lambda i: ops.add(ops.shl(t, 2), 16 * (i // 4) + 2 * ((i // 2) % 2) + i % 2)
    if ragged:  # tokens at or past the row's length score MASKED; only a block reaching past it pays for the mask
      n_valid = arith.fptosi(i32, memref.load(qs_ref, [arith.index_cast(index, ops.value(dc.LEN_SLOT))]))
      first = px.scalars(first)[0]
      partial = arith.cmpi(arith.CmpIPredicate.sgt, ops.add(first, BLOCK_S), n_valid)
      if_op = scf.IfOp(partial, [f32] * 8, has_else=True)
      with ir.InsertionPoint(if_op.then_block):
        base = ops.add(first, ops.shl(warp, 5))
        masked = mgpu.utils.c(MASKED, f32)
        out = [arith.select(arith.cmpi(arith.CmpIPredicate.slt, ops.add(base, token_of(i)), n_valid), x, masked)
               for i, x in enumerate(flat)]
        scf.yield_(out)
      with ir.InsertionPoint(if_op.else_block):
        scf.yield_(flat)
      flat = list(if_op.results)
    head_of = (lambda i: i % 2) if tokens_m else (lambda i: 0)  # which running max a score belongs to

    # the block max of each held head and the flush when it exceeds the running max
    bmax = []
    for e in range(len(ms)):
      mx = functools.reduce(arith.maximumf, [x for i, x in enumerate(flat) if head_of(i) == e])
      for mask in ((4, 8, 16) if tokens_m else (1, 2)):
        mx = arith.maximumf(mx, px.shfl_bfly(mx, mask))
      bmax.append(mx)
    above = functools.reduce(arith.ori, [arith.cmpf(arith.CmpFPredicate.OGT, b, m) for b, m in zip(bmax, ms)])
    flush = arith.cmpi(arith.CmpIPredicate.ne, px.vote_any(arith.extui(i32, above)), zi)
    state = [*acc_i, *ms, l_f, *acc_o, l_i]
    if_op = scf.IfOp(flush, [v.type for v in state], has_else=True)
    with ir.InsertionPoint(if_op.then_block):  # the flushed sums live in shared memory (32 registers fewer)
      m_new = [arith.maximumf(m, b) for m, b in zip(ms, bmax)]
      alpha = [px.ex2(arith.subf(m, mn)) for m, mn in zip(ms, m_new)]
      if tokens_m:  # the sums' columns are this thread's heads; l is head g's, held by lane g // 2
        cols = alpha
        src = ops.shr(g, 1)
        alpha_g = arith.select(arith.cmpi(arith.CmpIPredicate.ne, ops.band(g, 1), zi),
                               px.shfl_idx(alpha[1], src), px.shfl_idx(alpha[0], src))
      else:  # alpha is head g's; the sums' columns are heads 2t, 2t + 1
        cols = [px.shfl_idx(alpha[0], ops.shl(t, 3)), px.shfl_idx(alpha[0], ops.add(ops.shl(t, 3), 4))]
        alpha_g = alpha[0]
      for i in range(32):
        idx = [af_index(i)]
        memref.store(arith.mulf(arith.addf(memref.load(af_ref, idx), arith.sitofp(f32, acc_i[i])), cols[i % 2]),
                     af_ref, idx)
      new_o = [arith.mulf(acc_o[e], cols[e]) for e in range(2)]
      new_l = arith.mulf(arith.addf(l_f, arith.sitofp(f32, l_i)), alpha_g)
      scf.yield_([*[zi] * 32, *m_new, new_l, *new_o, zi])
    with ir.InsertionPoint(if_op.else_block):
      scf.yield_(state)
    res = list(if_op.results)
    acc_i, ms = res[:32], res[32:32 + len(ms)]
    l_f, acc_o, l_i = res[32 + len(ms)], res[33 + len(ms):35 + len(ms)], res[35 + len(ms)]

    # p8 = round(127 · 2^(s − m)); 0 while the split has seen no stored token (m = MASKED)
    m_p = [arith.select(arith.cmpf(arith.CmpFPredicate.OGT, m, mgpu.utils.c(0.5 * MASKED, f32)), m,
                        mgpu.utils.c(float("inf"), f32)) for m in ms]
    p8 = [px.floor(arith.addf(arith.mulf(px.ex2(arith.subf(x, m_p[head_of(i)])), mgpu.utils.c(P_LEVELS, f32)),
                            mgpu.utils.c(0.5, f32))) for i, x in enumerate(flat)]
    if tokens_m:  # [token, head] pairs -> movmatrix -> pb16[nt]: p8 of head g, tokens key_token(nt, 2t + 0 / 1)
      pb16 = [px.movmatrix_t(px.f16x2(p8[4 * mt + 2 * h], p8[4 * mt + 2 * h + 1])) for mt in range(2) for h in range(2)]
    else:
      pb16 = [px.f16x2(p8[2 * nt], p8[2 * nt + 1]) for nt in range(4)]
    # B of the value sums (int8): tokens 4t..4t+3 (n-tiles 0, 1), 16+4t.. (2, 3): an f16 integer + 1024 holds it in
    # its low byte
    bias = ops.value(0x64006400)
    low = [px.asm([i32], [x, bias], "add.rn.f16x2 $0, $1, $2;", "=r,r,r")[0] for x in pb16]
    packed = [px.asm([i32], [low[2 * h], low[2 * h + 1]], "prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r")[0]
              for h in range(2)]
    ones = ops.value(0x01010101)
    l_i = px.dp4a(packed[1], ones, px.dp4a(packed[0], ones, l_i))

    # value sums: m-tile (p, half): channels p·Q + 16·half + 0..15
    new_acc = list(acc_i)
    for half in range(2):
      words = {}
      for hr in range(2):
        for ht in range(2):
          row, col = value_code_source(ops, half, hr, ht, warp, g, t)
          words[hr, ht], = _tiled_word(v_ref, 4, row, col, width=BLOCK_S, sw=128)
      for p in range(PLANES):
        a = [value_plane(ops, words[hr, ht], p) for ht in range(2) for hr in range(2)]
        mt = 2 * p + half
        new_acc[4 * mt:4 * mt + 4] = px.mma("m16n8k32", "u8", a, packed, acc_i[4 * mt:4 * mt + 4])
    acc_i = new_acc
    if outliers:  # value outliers: k-step st covers tokens 16·st + 4t + 0..3
      c = [acc_o[0], acc_o[1], zf, zf]
      for st in range(2):
        row, col = value_outlier_source(ops, st, warp, g, t)
        word, = _tiled_word(vo_ref, 4, row, col, width=BLOCK_S, sw=128)
        a = [px.e4m3x2(word), zi, px.e4m3x2(ops.shr(word, 16)), zi]
        c = px.mma("m16n8k16", "f16", a, [pb16[2 * st], pb16[2 * st + 1]], c)
      acc_o = c[:2]
    m_vals = ms if tokens_m else [ms[0], ms[0]]
    return (px.fragment(acc_i, ACC_SHAPE, jnp.int32), px.fragment([*m_vals, l_f, *acc_o, zf, zf, zf], MISC_SHAPE,
                                                              jnp.float32),
            px.fragment([l_i, zi, zi, zi], LI_SHAPE, jnp.int32))

  return step


def acc_row(ops, ch):
  """Channel -> row of the wgmma core's ACC order (`oskvp_value_sums_mgpu.acc_rows` at Q = 32: channel
  [p2, p1, w, i] = [2, 2, 4, 8] -> row [p2, w, p1, i]), so that the output is `decode_core_splits`'s."""
  p2, p1 = ops.band(ch, 64), ops.band(ops.shr(ch, 5), 1)
  return ops.add(ops.add(p2, ops.shl(ops.band(ops.shr(ch, 3), 3), 4)), ops.add(ops.shl(p1, 3), ops.band(ch, 7)))


def _finish(outliers: bool, key_rows: str):
  """After the pipeline: the four warps' states merged by log-sum-exp into the program's output tiles in shared
  memory (o [H, 8] in ACC row order, ml [32]: m in [0, 8), l in [8, 16), zeros, oo [8 heads, 8 channels]), through
  x [64] (the warps' m and l) and six warpgroup barriers; the warps add their weighted sums into o and oo in turn.
  The output buffers take the ring's memory, which a lagging warp may still read in its last step: hence the first
  barrier."""
  tokens_m = key_rows == "tokens"
  wg = plgpu.Layout.WGMMA
  arg_types = (wg, wg, wg, plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), plgpu.RefType()) + \
      ((plgpu.RefType(),) if outliers else ())

  @plgpu.inline_mgpu(arg_types=arg_types)
  def finish(_, acc_i, misc, li, af_ref, o_ref, ml_ref, x_ref, *rest):
    ops, f32, index = rg.Mlir(), px.f32(), ir.IndexType.get()
    as_index = lambda v: arith.index_cast(index, ops.value(v))
    warp, lane = rg.thread_coords(ops)
    g, t = ops.shr(lane, 2), ops.band(lane, 3)
    acc_i, misc, li = px.scalars(acc_i), px.scalars(misc), px.scalars(li)
    l_f = misc[2]
    af_index = _flushed_index(warp, lane)
    total = [arith.addf(memref.load(af_ref, [af_index(i)]), arith.sitofp(f32, acc_i[i])) for i in range(32)]
    total = [x if i < 8 else arith.mulf(x, mgpu.utils.c(VALUE_PLANE_SCALE[i // 8], f32))  # register i: plane i // 8
             for i, x in enumerate(total)]
    l = arith.addf(l_f, arith.sitofp(f32, li[0]))
    l = arith.addf(l, px.shfl_bfly(l, 1))
    l = arith.addf(l, px.shfl_bfly(l, 2))
    is_first = lambda v: arith.cmpi(arith.CmpIPredicate.eq, v, ops.value(0))
    mgpu.utils.warpgroup_barrier()  # every warp is past its last read of the ring

    def when(cond, fn):
      if_op = scf.IfOp(cond)
      with ir.InsertionPoint(if_op.then_block):
        fn()
        scf.yield_([])

    def publish_l():
      memref.store(l, x_ref, [as_index(ops.add(32, ops.add(ops.shl(warp, 3), g)))])
      if not tokens_m:  # the running max is head g's
        memref.store(misc[0], x_ref, [as_index(ops.add(ops.shl(warp, 3), g))])

    def publish_m():  # "tokens": each thread holds the maxima of heads 2t, 2t + 1
      for e in range(2):
        memref.store(misc[e], x_ref, [as_index(ops.add(ops.shl(warp, 3), ops.add(ops.shl(t, 1), e)))])

    when(is_first(t), publish_l)
    if tokens_m:
      when(is_first(g), publish_m)
    mgpu.utils.warpgroup_barrier()

    def weight(head):  # (the program's max of head, this warp's weight 2^(m_w − max))
      ms = [memref.load(x_ref, [as_index(ops.add(8 * v, head))]) for v in range(WARPS)]
      top = functools.reduce(arith.maximumf, ms)
      return top, px.ex2(arith.subf(memref.load(x_ref, [as_index(ops.add(ops.shl(warp, 3), head))]), top))

    cols = [weight(ops.shl(t, 1))[1], weight(ops.add(ops.shl(t, 1), 1))[1]]
    top_g, own = weight(g)
    vec2 = ir.VectorType.get((2,), f32)
    oo_ref = rest[0] if outliers else None
    for v in range(WARPS):  # warp v adds its weighted sums to what warps 0..v-1 left
      def add(v=v):
        for p in range(PLANES):
          for half in range(2):
            mt = 2 * p + half
            for hr in range(2):  # c0, c1: channel row g; c2, c3: row 8 + g; columns (heads) 2t, 2t + 1
              row = as_index(acc_row(ops, ops.add(p * Q + 16 * half + 8 * hr, g)))
              col = as_index(ops.shl(t, 1))
              vals = [arith.mulf(total[4 * mt + 2 * hr + e], cols[e]) for e in range(2)]
              if v:
                old = vector.load(vec2, o_ref, [row, col])
                vals = [arith.addf(vals[e], vector.extract(old, dynamic_position=[],
                                                           static_position=ir.DenseI64ArrayAttr.get([e])))
                        for e in range(2)]
              vector.store(vector.from_elements(vec2, vals), o_ref, [row, col])
        if outliers:
          for e in range(2):  # [head 2t + e, channel g]
            idx = [as_index(ops.add(ops.shl(t, 1), e)), as_index(g)]
            val = arith.mulf(misc[3 + e], cols[e])
            memref.store(arith.addf(val, memref.load(oo_ref, idx)) if v else val, oo_ref, idx)

        def head_sums():
          lw = arith.mulf(l, own)
          idx = [as_index(ops.add(g, N))]
          memref.store(arith.addf(lw, memref.load(ml_ref, idx)) if v else lw, ml_ref, idx)
          if not v:
            memref.store(top_g, ml_ref, [as_index(g)])
            memref.store(mgpu.utils.c(0.0, f32), ml_ref, [as_index(ops.add(g, 2 * N))])  # the row's unused tail
            memref.store(mgpu.utils.c(0.0, f32), ml_ref, [as_index(ops.add(g, 3 * N))])

        when(is_first(t), head_sums)

      when(arith.cmpi(arith.CmpIPredicate.eq, warp, ops.value(v)), add)
      mgpu.utils.warpgroup_barrier()

  return finish


def _kernel(*refs, q_smem, qs_smem, af_smem, bar, qo_smem=None, steps: int, max_concurrent_steps: int, ablate: str,
            ragged: bool, outliers: bool, qo_width: int, key_rows: str, value_blocks: bool):
  # kc_ref uint8 [BK, S, Q]; vc_ref uint8 [BK, Q, S] (value_blocks: [BK, S/128 · Q, 128], `vl.ring_operand`, and
  # vo_ref likewise); qd_ref int8 [BK, 8, H]; qs_ref f32 [BK, 32] (scales, length at
  # 8); with outliers ko_ref fp8 [BK, S/8, 64], vo_ref fp8 [BK, 8, S], qo_ref f16 [BK, 8, 8 or 16]. acc_out f32
  # [BK, splits, H, 8] (ACC row order); ml_out f32 [BK, splits, 32]; acco_out f32 [BK, splits, 8, 8].
  if outliers:
    kc_ref, vc_ref, qd_ref, qs_ref, ko_ref, vo_ref, qo_ref, acc_out, ml_out, acco_out = refs
  else:
    kc_ref, vc_ref, qd_ref, qs_ref, acc_out, ml_out = refs
  bk, sp = jax.lax.axis_index("bk"), jax.lax.axis_index("split")
  dc.copy_row_inputs(bk, bar, (qd_ref, q_smem), (qs_ref, qs_smem), *([(qo_ref, qo_smem)] if outliers else []))
  tokens = pl.ds(sp * (steps * BLOCK_S), steps * BLOCK_S)
  blk = (lambda i: 0) if ablate == "l2_resident" else (lambda i: i)
  v_spec, v_src = vl.ring_source(vc_ref, Q, bk, sp, steps, BLOCK_S, blk, blocks=value_blocks)
  specs = [plgpu.BlockSpec((BLOCK_S, Q), lambda i: (blk(i), 0), transforms=ks.swizzled(Q)), v_spec]
  srcs = [kc_ref.at[bk, tokens], v_src]
  if outliers:
    vo_spec, vo_src = vl.ring_source(vo_ref, OUTLIERS, bk, sp, steps, BLOCK_S, blk, blocks=value_blocks)
    specs += [plgpu.BlockSpec((BLOCK_S // KO_TOKENS, KO_TOKENS * OUTLIERS), lambda i: (blk(i), 0)), vo_spec]
    rows = steps * BLOCK_S // KO_TOKENS
    srcs += [ko_ref.at[bk, pl.ds(sp * rows, rows)], vo_src]
  wg = plgpu.Layout.WGMMA
  init = _init_state()(af_smem)
  step = _step(outliers, ragged, qo_width, key_rows)

  def body(idx, k_smem, v_smem, *rest):
    ko, vo, carry = rest if outliers else (None, None, rest[0])
    if ablate == "no_compute":
      return carry
    extra = (ko, vo, qo_smem) if outliers else ()
    if ragged:
      first = (sp * steps + idx[0]) * BLOCK_S
      extra += (plgpu.layout_cast(jnp.full(LI_SHAPE, first, jnp.int32), wg),)
    return step(k_smem, v_smem, q_smem, qs_smem, af_smem, *carry, *extra)

  state = plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs, max_concurrent_steps=max_concurrent_steps,
                              init_carry=init)(*srcs)

  def store(o_smem, ml_smem, x_smem, *oo):
    _finish(outliers, key_rows)(*state, af_smem, o_smem, ml_smem, x_smem, *oo)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, acc_out.at[bk, sp])
    plgpu.copy_smem_to_gmem(ml_smem, ml_out.at[bk, sp])
    if outliers:
      plgpu.copy_smem_to_gmem(oo[0], acco_out.at[bk, sp])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(store, plgpu.SMEM((4 * Q, N), jnp.float32), plgpu.SMEM((32,), jnp.float32),
                plgpu.SMEM((64,), jnp.float32), *([plgpu.SMEM((N, OUTLIERS), jnp.float32)] if outliers else []))


def _check_inputs(kcodes, vcodes, qd, qs, splits, max_concurrent_steps):
  """The wgmma core's checks at 128-token blocks, and H = 128; returns (BK, S, Q)."""
  check = dc._check_inputs  # pylint: disable=protected-access
  bk, s, q = check(kcodes, vcodes, qd, qs, BLOCK_S, splits, max_concurrent_steps)
  if q != Q:
    raise ValueError(f"code bytes per token Q={q}: decode_core_mma takes H = 128 (Q = {Q}) only")
  if s // splits > MAX_SPLIT_TOKENS:
    raise ValueError(f"splits={splits}: {s // splits} tokens per program (S={s}) would overflow the int32 value "
                     f"sums; at most {MAX_SPLIT_TOKENS} (`value_plane`)")
  return bk, s, q


def _core_call(kcodes, vcodes, qd, qs_row, kout2=None, vout=None, qo=None, *, splits: int,
               max_concurrent_steps: int, ablate: str, ragged: bool, key_rows: str = KEY_ROW_DEFAULT):
  """The kernel on prepared inputs (`dc._core_call`'s, but kout2 fp8 [BK, S/8, 64] (eight tokens a row: TMA rows of
  64 bytes, not 16) and qo f16 [BK, 8, 8 or 16]) -> (acc f32 [BK, splits, H, 8] in
  ACC row order, ml f32 [BK, splits, 32], acco f32 [BK, splits, 8, 8] ([head, channel]) with outliers)."""
  if key_rows not in KEY_ROWS:
    raise ValueError(f"key_rows={key_rows!r} must be one of {KEY_ROWS}")
  bk, s, q = kcodes.shape
  outliers = kout2 is not None
  value_blocks = dc.check_value_layouts(vcodes, vout)
  body = functools.partial(_kernel, steps=s // (splits * BLOCK_S), max_concurrent_steps=max_concurrent_steps,
                           ablate=ablate, ragged=ragged, outliers=outliers,
                           qo_width=qo.shape[-1] if outliers else 0, key_rows=key_rows, value_blocks=value_blocks)
  out_type = (jax.ShapeDtypeStruct((bk, splits, 4 * q, N), jnp.float32),
              jax.ShapeDtypeStruct((bk, splits, 32), jnp.float32))
  scratch = dict(q_smem=plgpu.SMEM((N, 4 * q), jnp.int8, transforms=ks.swizzled(128)),
                 qs_smem=plgpu.SMEM((dc.QS_SLOTS,), jnp.float32),
                 af_smem=plgpu.SMEM((FLUSHED,), jnp.float32),
                 bar=plgpu.Barrier(num_arrivals=3 if outliers else 2, num_barriers=1))
  args = (kcodes, vl.ring_operand(vcodes), qd, qs_row)
  if outliers:
    out_type += (jax.ShapeDtypeStruct((bk, splits, N, OUTLIERS), jnp.float32),)
    scratch["qo_smem"] = plgpu.SMEM(qo.shape[1:], jnp.float16)
    args += (kout2, vl.ring_operand(vout), qo)
  kernel = plgpu.kernel(body, out_type=out_type, grid=(bk, splits), grid_names=("bk", "split"),
                        scratch_types=scratch,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
  return kernel(*args)


@functools.partial(jax.jit, static_argnames=("splits", "max_concurrent_steps", "key_rows"))
def decode_core_mma_splits(kcodes: jax.Array, vcodes: jax.Array, qd: jax.Array, qs_row: jax.Array,
                           kout: jax.Array, vout: jax.Array, qo16: jax.Array, *, splits: int = 16,
                           max_concurrent_steps: int = 2, key_rows: str = KEY_ROW_DEFAULT):
  """`dc.decode_core_splits` (the same arguments and outputs, one value-outlier part) on the warp-level core: for
  the wired path's Pallas epilogue, which merges the splits and the residual window."""
  bk, s, _ = _check_inputs(kcodes, vcodes, qd, qs_row[:, :N], splits, max_concurrent_steps)
  dc.check_split_inputs(bk, s, qs_row, kout, vout, qo16)
  acc, ml, acco = _core_call(kcodes, vcodes, qd, qs_row, kout.reshape(bk, s // KO_TOKENS, KO_TOKENS * OUTLIERS),
                             vout, qo16,
                             splits=splits, max_concurrent_steps=max_concurrent_steps, ablate="", ragged=True,
                             key_rows=key_rows)
  return acc, ml, acco[:, :, None]


@functools.partial(jax.jit, static_argnames=("splits", "max_concurrent_steps", "ablate", "return_lse2", "key_rows"))
def decode_core_mma(kcodes: jax.Array, vcodes: jax.Array, qd: jax.Array, qs: jax.Array,
                    lengths: jax.Array | None = None, kout: jax.Array | None = None, vout: jax.Array | None = None,
                    qo: jax.Array | None = None, *, splits: int = 16, max_concurrent_steps: int = 2,
                    ablate: str = "", return_lse2: bool = False, key_rows: str = KEY_ROW_DEFAULT):
  """`dc.decode_core_mgpu`'s computation (same arguments and outputs; block_s is 128) on warp-level mma.sync (see
  the module docstring); the arithmetic of `decode_core_mma_reference`. GPU only (no interpret mode).

  ablate (timing only): "no_compute" (the TMA ring alone), "l2_resident" (every step reloads the split's first
  block: the compute side alone). key_rows: the key scores' orientation ("heads" or "tokens", `_step`)."""
  bk, s, q = _check_inputs(kcodes, vcodes, qd, qs, splits, max_concurrent_steps)
  if ablate not in ABLATIONS:
    raise ValueError(f"ablate={ablate!r} must be one of {ABLATIONS}")
  outliers = dc.check_optional_inputs(bk, s, lengths, kout, vout, qo)
  qs_row = dc.padded_scales(qs, lengths, s)
  extra = (kout.reshape(bk, s // KO_TOKENS, KO_TOKENS * OUTLIERS), vout, qo) if outliers else ()
  res = _core_call(kcodes, vcodes, qd, qs_row, *extra, splits=splits, max_concurrent_steps=max_concurrent_steps,
                   ablate=ablate, ragged=lengths is not None, key_rows=key_rows)
  mean, mean_o, lse2 = dc.merge_splits(res[0], res[1], res[2] if outliers else None)
  outs = (vs.channel_rows(mean, q, 2),) + ((mean_o,) if outliers else ()) + ((lse2,) if return_lse2 else ())
  return outs[0] if len(outs) == 1 else outs
