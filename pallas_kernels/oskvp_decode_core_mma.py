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
  value sums   O^T [16 channels, 8 heads] += vcodes [16, 32 tokens] · p8^T       (8 m-tiles, m16n8k32 s8)
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

GPU only: the kernel is inline Mosaic (`plgpu.inline_mgpu`) and PTX, which Mosaic's CPU interpreter does not run.
On the CPU, `emulate` runs the same index math (`rg.Ints`) on the PTX fragment layouts in numpy, and the tests check
the lowering. H = 128 (Q = 32 code bytes per token) only. Measured: `benchmarks/notes_mgpu_oskvp.md` §24.
"""

from __future__ import annotations

import functools

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.lib.mlir.dialects import llvm
from jax._src.lib.mlir.dialects import memref
from jax._src.lib.mlir.dialects import scf
from jax._src.lib.mlir.dialects import vector
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels import oskvp_value_sums_mgpu as vs

N = dc.N  # query heads per kv head, padded
OUTLIERS = rg.OUTLIERS
WARPS = 4  # warps per program; each owns WARP_TOKENS of every block
WARP_TOKENS = 32
BLOCK_S = WARPS * WARP_TOKENS  # tokens per pipeline step
Q = 32  # code bytes per token (H = 128)
PLANES = 4  # 2-bit codes per byte
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


def key_channel(p: int, k: int, t: int) -> int:
  """Channel of row k (0..31) of the key scores' k-step p, as seen by thread column t = k // 4 % 4 (CPU model)."""
  return p * Q + 8 * t + 4 * (k // 16) + k % 4


def value_code_source(ops, half: int, hi_row: int, hi_token: int, warp, g, t):
  """The value-code word of thread (warp, g, t) for m-tile half `half` (channel rows 16·half..), row half hi_row
  (rows g or 8 + g) and token half hi_token (tokens 4t.. or 16 + 4t..): (byte row of the [Q, 128] tile, first
  token); 4 bytes = 4 tokens; plane p of it is channel p·Q + byte row."""
  return ops.add(16 * half + 8 * hi_row, g), ops.add(ops.shl(warp, 5), ops.add(16 * hi_token, ops.shl(t, 2)))


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
  valid = dc._valid(bk, s, lengths)[:, :, pos]
  return dc.blockwise_model(kcodes[:, pos], vcodes[:, :, pos], qd, qs, valid,
                            None if kout is None else kout[:, pos], None if vout is None else vout[:, :, pos], qo,
                            block_s=WARP_TOKENS, splits=WARPS * splits)


# ---- the CPU model of the GPU route: the same index math, the PTX fragment layouts, numpy over the 32 lanes ----

def _frag_rows(kind: str):
  """PTX fragment layouts of mma.sync m16n8k{32 s8, 8 f16, 16 f16} per lane (g, t) = (lane // 4, lane % 4):
  A registers -> [(row, first k)] (elements k, k + 1, ... in the register), B registers -> [first k]."""
  if kind == "k32":
    return [(0, 0), (8, 0), (0, 16), (8, 16)], [0, 16], 4
  if kind == "k8":
    return [(0, 0), (8, 0)], [0], 2
  return [(0, 0), (8, 0), (0, 8), (8, 8)], [0, 8], 2


def mma_emulate(kind: str, a, b, c):
  """numpy mma.sync of one warp: a [32 lanes, nA, e], b [32, nB, e], c [32, 4] -> d [32, 4] (float64; PTX layouts:
  element i of A register j of lane (g, t) is A[g + rows_j, k_j + e·t + i], of B register j B[k_j + e·t + i, g];
  C register j is C[g + 8·(j // 2), 2t + j % 2])."""
  a_regs, b_regs, e = _frag_rows(kind)
  kk = {"k32": 32, "k8": 8, "k16": 16}[kind]
  am, bm = np.zeros((16, kk)), np.zeros((kk, 8))
  for lane in range(32):
    g, t = lane // 4, lane % 4
    for j, (r0, k0) in enumerate(a_regs):
      am[g + r0, k0 + e * t:k0 + e * t + e] = a[lane, j]
    for j, k0 in enumerate(b_regs):
      bm[k0 + e * t:k0 + e * t + e, g] = b[lane, j]
  d = am @ bm
  out = np.array(c, dtype=np.float64)
  for lane in range(32):
    g, t = lane // 4, lane % 4
    for j in range(4):
      out[lane, j] += d[g + 8 * (j // 2), 2 * t + j % 2]
  return out


def _bytes(word: np.ndarray) -> np.ndarray:
  """uint32 words [...] -> their 4 bytes [..., 4] (byte 0 first), as int64."""
  return ((word[..., None] >> (8 * np.arange(4))) & 0xFF).astype(np.int64)


def emulate_program(kc, vc, qd, qs, n_valid, ko=None, vo=None, qo=None, key_rows: str = KEY_ROW_DEFAULT):
  """The GPU route of one program in numpy: kc uint8 [L, Q], vc uint8 [Q, L] (the program's split of L tokens),
  qd int8 [8, H], qs f32 [8], n_valid (tokens of the split stored: the kernel compares each token with the row's
  length), ko fp8 [L, 8], vo fp8 [Q=8, L], qo f16 [8, 8] -> (acc [4, H, 8], ml [4, 32], acco [4, 8, 8]) as the
  kernel stores them. Uses `key_code_source`, `value_code_source`, the outlier sources and the packing of the kernel,
  so a wrong index in any of them shows up against `decode_core_mma_reference`. With key_rows="tokens" the key
  scores run in that orientation and reach the heads' layout through the emulated movmatrix transposes (applied to
  the scores: the kernel transposes p8, the same permutation)."""
  ops = rg.Ints
  lanes = np.arange(32)
  g, t = lanes // 4, lanes % 4
  length = kc.shape[0]
  acc_out, ml_out, acco_out = np.zeros((WARPS, 4 * Q, N)), np.zeros((WARPS, 32)), np.zeros((WARPS, N, OUTLIERS))
  kw = kc.view(np.uint8).reshape(length, Q // 4, 4).astype(np.uint32)
  kw = (kw * (1 << (8 * np.arange(4, dtype=np.uint32)))).sum(-1).astype(np.uint32)  # [L, Q/4] words
  plane = lambda w, p: (w >> np.uint32(2 * p)) & np.uint32(0x03030303)
  qa = np.zeros((32, PLANES, 4, 4), np.int64)  # lane, k-step, register, byte
  for p in range(PLANES):
    for lane in lanes:
      qa[lane, p, 0] = qd[g[lane], p * Q + 8 * t[lane]:p * Q + 8 * t[lane] + 4]
      qa[lane, p, 2] = qd[g[lane], p * Q + 8 * t[lane] + 4:p * Q + 8 * t[lane] + 8]
  for w in range(WARPS):
    acc_i, acc_f = np.zeros((32, 32)), np.zeros((32, 32))
    m, l_f, l_i, acc_o = np.full(32, MASKED), np.zeros(32), np.zeros(32), np.zeros((32, 2))
    for base in range(0, length, BLOCK_S):
      words, pairs = [], []  # per n-tile: each lane's code words [32, 2] and key-outlier pair [32, 2]
      for nt in range(4):
        src = [key_code_source(ops, nt, w, int(g[x]), int(t[x])) for x in lanes]
        words.append(np.array([kw[base + r, c // 4:c // 4 + 2] for r, c in src]))
        if ko is not None:
          pair = np.zeros((32, 2))
          for x in lanes:
            r, col = key_outlier_source(ops, nt, w, int(g[x]), int(t[x]))
            pair[x] = ko[base + KO_TOKENS * r + col // 8, col % 8:col % 8 + 2]
          pairs.append(pair)
      qo_a = None if ko is None else qo[g[:, None], 2 * t[:, None] + np.arange(2)]  # [32, 2]
      if key_rows == "tokens":  # S [16 tokens, 8 heads] per m-tile, then each 8 × 8 block transposed (movmatrix)
        scores = [None] * 4
        for mt in range(2):
          lo, hi = words[2 * mt], words[2 * mt + 1]
          c = np.zeros((32, 4))
          for p in range(PLANES):
            a = np.stack([_bytes(plane(lo[:, 0], p)), _bytes(plane(hi[:, 0], p)), _bytes(plane(lo[:, 1], p)),
                          _bytes(plane(hi[:, 1], p))], 1)
            c = mma_emulate("k32", a, np.stack([qa[:, p, 0], qa[:, p, 2]], 1), c)
          c = c * qs[np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1], 1)]
          if ko is not None:
            c = mma_emulate("k8", np.stack([pairs[2 * mt], pairs[2 * mt + 1]], 1), qo_a[:, None], c)
          for h in range(2):
            tok = base + 32 * w + np.array([key_token(ops, 2 * mt + h, int(gg)) for gg in g])
            block = np.where((tok < n_valid)[:, None], c[:, 2 * h:2 * h + 2], MASKED)  # lane (g, t): row g, 2t..
            # movmatrix: lane (g, t) receives row g, columns 2t, 2t + 1 of the transpose = element g % 2 of lanes
            # (2t, g // 2) and (2t + 1, g // 2)
            src = lambda e: 4 * (2 * t + e) + g // 2
            scores[2 * mt + h] = np.stack([block[src(0), g % 2], block[src(1), g % 2]], 1)
      else:  # S^T [16 (8 heads), 8 tokens] per n-tile
        scores = []
        for nt in range(4):
          c = np.zeros((32, 4))
          for p in range(PLANES):
            c = mma_emulate("k32", qa[:, p], _bytes(plane(words[nt], p)), c)
          sc_nt = c[:, :2] * qs[g][:, None]
          if ko is not None:
            sc_nt = mma_emulate("k8", np.stack([qo_a, np.zeros((32, 2))], 1), pairs[nt][:, None],
                                np.concatenate([sc_nt, np.zeros((32, 2))], 1))[:, :2]
          tok = base + 32 * w + np.array([[key_token(ops, nt, 2 * int(tt) + e) for e in range(2)] for tt in t])
          scores.append(np.where(tok < n_valid, sc_nt, MASKED))
      sc = np.stack(scores, 1)  # [32, 4 n-tiles, 2]
      bmax = sc.reshape(32, 8).max(1)
      bmax = np.maximum(bmax, bmax[lanes ^ 1])
      bmax = np.maximum(bmax, bmax[lanes ^ 2])
      if (bmax > m).any():
        m_new = np.maximum(m, bmax)
        alpha = np.exp2(m - m_new)
        cols = np.stack([alpha[8 * t], alpha[8 * t + 4]], 1)  # heads 2t, 2t + 1
        acc_f = (acc_f + acc_i) * np.tile(cols, 16)
        acc_o = acc_o * cols
        l_f = (l_f + l_i) * alpha
        acc_i, l_i, m = np.zeros_like(acc_i), np.zeros_like(l_i), m_new
      m_p = np.where(m > 0.5 * MASKED, m, np.inf)
      p8 = np.floor(np.exp2(sc - m_p[:, None, None]) * P_LEVELS + 0.5)  # [32, 4, 2]
      packed = np.stack([p8[:, 0:2].reshape(32, 4), p8[:, 2:4].reshape(32, 4)], 1)  # [32, 2 regs, 4 bytes]
      l_i = l_i + packed.sum((1, 2))
      for half in range(2):
        words = {}
        for hr in range(2):
          for ht in range(2):
            src = [value_code_source(ops, half, hr, ht, w, int(g[x]), int(t[x])) for x in lanes]
            words[hr, ht] = np.array([vc[r, base + col:base + col + 4] for r, col in src]).astype(np.uint32)
            words[hr, ht] = (words[hr, ht] * (1 << (8 * np.arange(4, dtype=np.uint32)))).sum(-1).astype(np.uint32)
        for p in range(PLANES):
          a = np.stack([_bytes(plane(words[0, 0], p)), _bytes(plane(words[1, 0], p)),
                        _bytes(plane(words[0, 1], p)), _bytes(plane(words[1, 1], p))], 1)
          mt = 2 * p + half
          acc_i[:, 4 * mt:4 * mt + 4] = mma_emulate("k32", a, packed, acc_i[:, 4 * mt:4 * mt + 4])
      if vo is not None:
        c = np.concatenate([acc_o, np.zeros((32, 2))], 1)
        for st in range(2):
          src = [value_outlier_source(ops, st, w, int(g[x]), int(t[x])) for x in lanes]
          quad = np.array([vo[r, base + col:base + col + 4] for r, col in src])  # [32, 4]
          a = np.zeros((32, 4, 2))
          a[:, 0], a[:, 2] = quad[:, 0:2], quad[:, 2:4]
          b = np.stack([p8[:, 2 * st], p8[:, 2 * st + 1]], 1)  # [32, 2 regs, 2]
          c = mma_emulate("k16", a, b, c)
        acc_o = c[:, :2]
    total = acc_f + acc_i
    l = l_f + l_i
    l = l + l[lanes ^ 1]
    l = l + l[lanes ^ 2]
    for lane in lanes:
      for p in range(PLANES):
        for half in range(2):
          mt = 2 * p + half
          for hr in range(2):
            ch = p * Q + 16 * half + 8 * hr + g[lane]
            acc_out[w, ch, 2 * t[lane]:2 * t[lane] + 2] = total[lane, 4 * mt + 2 * hr:4 * mt + 2 * hr + 2]
      if t[lane] == 0:
        ml_out[w, g[lane]], ml_out[w, N + g[lane]] = m[lane], l[lane]
      for e in range(2):
        acco_out[w, 2 * t[lane] + e, g[lane]] = acc_o[lane, e]
  return acc_out, ml_out, acco_out


def emulate(kcodes, vcodes, qd, qs, lengths=None, kout=None, vout=None, qo=None, *, splits: int,
            key_rows: str = KEY_ROW_DEFAULT):
  """`decode_core_mma` through `emulate_program` (numpy, every program), merged as the wrapper merges."""
  kc, vc, qd, qs = (np.asarray(x) for x in (kcodes, vcodes, qd, qs))
  bk, s, _ = kc.shape
  span = s // splits
  f32 = lambda x: None if x is None else np.asarray(jnp.asarray(x).astype(jnp.float32))
  ko, vo, qo = f32(kout), f32(vout), f32(qo)
  outs = [[], [], []]
  for b in range(bk):
    for sp in range(splits):
      n_valid = (s if lengths is None else int(lengths[b])) - sp * span
      part = slice(sp * span, (sp + 1) * span)
      res = emulate_program(kc[b, part], vc[b, :, part], qd[b].astype(np.int64), qs[b], n_valid,
                            None if ko is None else ko[b, part], None if vo is None else vo[b, :, part],
                            None if qo is None else qo[b], key_rows)
      for lst, r in zip(outs, res):
        lst.append(r)
  acc = jnp.asarray(np.stack(outs[0]).reshape(bk, splits * WARPS, 4 * Q, N), jnp.float32)
  ml = jnp.asarray(np.stack(outs[1]).reshape(bk, splits * WARPS, 32), jnp.float32)
  acco = jnp.asarray(np.stack(outs[2]).reshape(bk, splits * WARPS, N, OUTLIERS), jnp.float32)
  mean, mean_o, _ = dc.merge_splits(acc, ml, acco if kout is not None else None)
  return mean if kout is None else (mean, mean_o)


# ---- PTX helpers (inside the kernel) ----

def _i32():
  return ir.IntegerType.get_signless(32)


def _f32():
  return ir.F32Type.get()


def _asm(types, operands, ptx, constraints):
  """Inline PTX with len(types) results (a struct when several)."""
  if len(types) == 1:
    return [llvm.inline_asm(types[0], operands, ptx, constraints)]
  out = llvm.inline_asm(llvm.StructType.get_literal(types), operands, ptx, constraints)
  return [llvm.extractvalue(ty, out, [i]) for i, ty in enumerate(types)]


def _regs(prefix_count: int, n: int) -> str:
  return "{" + ",".join(f"${prefix_count + i}" for i in range(n)) + "}"


def mma(shape: str, kind: str, a, b, c):
  """D = A · B + C of one `mma.sync.aligned.{shape}.row.col` per warp: kind "s8" (s32 accumulators) or "f16" (f32)."""
  integer = kind == "s8"
  ty = _i32() if integer else _f32()
  acc = "s32" if integer else "f32"
  ptx = (f"mma.sync.aligned.{shape}.row.col.{acc}.{kind}.{kind}.{acc} {_regs(0, 4)}, {_regs(4, len(a))}, "
         f"{_regs(4 + len(a), len(b))}, {_regs(4 + len(a) + len(b), 4)};")
  cc = "r" if integer else "f"
  constraints = ",".join([f"={cc}"] * 4 + ["r"] * (len(a) + len(b)) + [cc] * 4)
  return _asm([ty] * 4, [*a, *b, *c], ptx, constraints)


def _shfl_bfly(x, mask: int):
  return _asm([_f32()], [x], f"shfl.sync.bfly.b32 $0, $1, {mask}, 31, -1;", "=f,f")[0]


def _shfl_idx(x, lane):
  return _asm([_f32()], [x, lane], "shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=f,f,r")[0]


def _ex2(x):
  return _asm([_f32()], [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")[0]


def _vote_any(flag):
  """i32 flag (0 / 1) of each lane -> i32 1 if any lane of the warp has it."""
  return _asm([_i32()], [flag], "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.any.pred q, p, -1; "
              "selp.u32 $0, 1, 0, q; }", "=r,r")[0]


def _dp4a(a, b, c):
  return _asm([_i32()], [a, b, c], "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r")[0]


def _f16x2(lo, hi):
  """Two f32 -> one f16x2 register (lo in the low half)."""
  return _asm([_i32()], [hi, lo], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")[0]


def _e4m3x2(pair):
  """i32 whose low 16 bits are two e4m3 bytes -> f16x2 (byte 0 in the low half)."""
  i16 = ir.IntegerType.get_signless(16)
  return _asm([_i32()], [arith.trunci(i16, pair)], "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")[0]


def _load(ref, offset, nbytes: int):
  """nbytes (2, 4 or 8) at byte `offset` (an i32 value or int) of a shared-memory ref, as one aligned load: a list
  of i32 words (one i16 for 2 bytes). Explicit alignment: a vector.load of i8 elements may be split into bytes."""
  i64, i16 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(16)
  offset = mgpu.utils.c(offset, i64) if isinstance(offset, int) else arith.extui(i64, offset)
  ptr = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(ref), [offset], ir.IntegerType.get_signless(8))
  if nbytes == 2:
    return [llvm.load(i16, ptr, alignment=2)]
  if nbytes == 4:
    return [llvm.load(_i32(), ptr, alignment=4)]
  pair = llvm.load(ir.VectorType.get((2,), _i32()), ptr, alignment=8)
  return [vector.extract(pair, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i])) for i in range(2)]


def tile_offset(ops, row, col, width: int, sw: int):
  """Byte offset of (row, col) in a byte tile [R, width] that TMA stored in tiles of 8 × width rows, swizzled by
  sw bytes (the 16-byte chunk index XOR-ed with address bits 7+ of the row within its tile)."""
  xor = ops.band(ops.shr(ops.mul(ops.band(row, 7), width), 7), sw // 16 - 1)
  return ops.add(ops.mul(row, width), ops.bxor(col, ops.shl(xor, 4)))


def _tiled_word(ref, nbytes: int, row, col, *, width: int, sw: int):
  return _load(ref, tile_offset(rg.Mlir(), row, col, width, sw), nbytes)


def _scalars(arr) -> list:
  """A FragmentedArray's per-thread values, flattened."""
  out = []
  for reg in arr.registers.flat:
    for i in range(ir.VectorType(reg.type).shape[0]):
      out.append(vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i])))
  return out


def _fragment(values: list, like_shape: tuple[int, int], dtype) -> mgpu.FragmentedArray:
  """Per-thread values -> a FragmentedArray [like_shape] in the WGMMA layout (an opaque carrier of registers)."""
  shape = mgpu.WGMMA_LAYOUT.registers_shape(like_shape)
  regs = np.empty(shape, dtype=object)
  flat = regs.reshape(-1)
  vec_ty = ir.VectorType.get((2,), values[0].type)
  for i in range(flat.size):
    flat[i] = vector.from_elements(vec_ty, values[2 * i:2 * i + 2])
  return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT,
                              _is_signed=True if jnp.issubdtype(dtype, jnp.integer) else None)


# The carried state of a thread: acc_i int32 [32] (the value sums since the running max last grew: 8 m-tiles × 4),
# misc f32 [8] (the running max: of head g with key_rows="heads", of heads 2t, 2t + 1 with "tokens"; l_f; acc_o of
# heads 2t, 2t + 1), li int32 [4] (l_i), carried as WGMMA-layout arrays of these shapes; and in shared memory af f32 [4 warps · 32 · 32 lanes] (the flushed sums, relative to m:
# touched only when the max grows, so kept out of the registers).
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
    ops, f32 = rg.Mlir(), _f32()
    warp, lane = rg.thread_coords(ops)
    af_index = _flushed_index(warp, lane)
    zf = mgpu.utils.c(0.0, f32)
    for i in range(32):
      memref.store(zf, af_ref, [af_index(i)])
    masked = mgpu.utils.c(MASKED, f32)
    return (_fragment([ops.value(0)] * 32, ACC_SHAPE, jnp.int32), _fragment([masked, masked] + [zf] * 6, MISC_SHAPE,
                                                                             jnp.float32),
            _fragment([ops.value(0)] * 4, LI_SHAPE, jnp.int32))

  return init


def _movmatrix_t(x):
  """One 8 × 8 matrix of 16-bit values transposed across the warp (thread (g, t) holds row g, columns 2t, 2t + 1)."""
  return _asm([_i32()], [x], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")[0]


def _floor(x):
  return _asm([_f32()], [x], "cvt.rmi.f32.f32 $0, $1;", "=f,f")[0]


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
    ops, i32, f32, index = rg.Mlir(), _i32(), _f32(), ir.IndexType.get()
    ko_ref, vo_ref, qo_ref = rest[:3] if outliers else (None, None, None)
    first = rest[-1] if ragged else None
    warp, lane = rg.thread_coords(ops)
    g, t = ops.shr(lane, 2), ops.band(lane, 3)
    acc_i, misc, li = _scalars(acc_i), _scalars(misc), _scalars(li)
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
      qo_w, = _load(qo_ref, ops.add(ops.mul(g, 2 * qo_width), ops.shl(t, 2)), 4)  # qo f16 [8, W]: row g, 2t, 2t + 1
    code_words, outlier_pairs = [], []
    for nt in range(4):
      row, col = key_code_source(ops, nt, warp, g, t)
      code_words.append(_tiled_word(k_ref, 8, row, col, width=Q, sw=Q))
      if outliers:
        orow, ocol = key_outlier_source(ops, nt, warp, g, t)
        pair, = _load(ko_ref, ops.add(ops.shl(orow, 6), ocol), 2)  # ko fp8 [16, 64]
        outlier_pairs.append(_e4m3x2(arith.extui(i32, pair)))
    plane = lambda w, p: ops.band(ops.shr(w, 2 * p) if p else w, 0x03030303)
    if tokens_m:
      # S [16 tokens, 8 heads] per m-tile mt: rows g / 8 + g are the tokens of n-tiles 2mt / 2mt + 1, column g
      scores = []  # per m-tile: [s(row g, head 2t), s(g, 2t + 1), s(8 + g, 2t), s(8 + g, 2t + 1)]
      scale = [load_qs(ops.shl(t, 1)), load_qs(ops.add(ops.shl(t, 1), 1))]
      for mt in range(2):
        lo, hi = code_words[2 * mt], code_words[2 * mt + 1]
        c = [zi] * 4
        for p in range(PLANES):
          c = mma("m16n8k32", "s8", [plane(lo[0], p), plane(hi[0], p), plane(lo[1], p), plane(hi[1], p)],
                  qw[p], c)
        sc = [arith.mulf(arith.sitofp(f32, c[j]), scale[j % 2]) for j in range(4)]
        if outliers:
          sc = mma("m16n8k8", "f16", [outlier_pairs[2 * mt], outlier_pairs[2 * mt + 1]], [qo_w], sc)
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
          c = mma("m16n8k32", "s8", [qw[p][0], zi, qw[p][1], zi], [plane(w, p) for w in code_words[nt]], c)
        sc = [arith.mulf(arith.sitofp(f32, c[e]), scale) for e in range(2)]
        if outliers:
          sc = mma("m16n8k8", "f16", [qo_w, zi], [outlier_pairs[nt]], [sc[0], sc[1], zf, zf])[:2]
        flat += sc
      token_of = lambda i: ops.add(ops.shl(t, 2), 16 * (i // 4) + 2 * ((i // 2) % 2) + i % 2)
    if ragged:  # tokens at or past the row's length score MASKED; only a block reaching past it pays for the mask
      n_valid = arith.fptosi(i32, memref.load(qs_ref, [arith.index_cast(index, ops.value(dc.LEN_SLOT))]))
      first = _scalars(first)[0]
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
        mx = arith.maximumf(mx, _shfl_bfly(mx, mask))
      bmax.append(mx)
    above = functools.reduce(arith.ori, [arith.cmpf(arith.CmpFPredicate.OGT, b, m) for b, m in zip(bmax, ms)])
    flush = arith.cmpi(arith.CmpIPredicate.ne, _vote_any(arith.extui(i32, above)), zi)
    state = [*acc_i, *ms, l_f, *acc_o, l_i]
    if_op = scf.IfOp(flush, [v.type for v in state], has_else=True)
    with ir.InsertionPoint(if_op.then_block):  # the flushed sums live in shared memory (32 registers fewer)
      m_new = [arith.maximumf(m, b) for m, b in zip(ms, bmax)]
      alpha = [_ex2(arith.subf(m, mn)) for m, mn in zip(ms, m_new)]
      if tokens_m:  # the sums' columns are this thread's heads; l is head g's, held by lane g // 2
        cols = alpha
        src = ops.shr(g, 1)
        alpha_g = arith.select(arith.cmpi(arith.CmpIPredicate.ne, ops.band(g, 1), zi),
                               _shfl_idx(alpha[1], src), _shfl_idx(alpha[0], src))
      else:  # alpha is head g's; the sums' columns are heads 2t, 2t + 1
        cols = [_shfl_idx(alpha[0], ops.shl(t, 3)), _shfl_idx(alpha[0], ops.add(ops.shl(t, 3), 4))]
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
    p8 = [_floor(arith.addf(arith.mulf(_ex2(arith.subf(x, m_p[head_of(i)])), mgpu.utils.c(P_LEVELS, f32)),
                            mgpu.utils.c(0.5, f32))) for i, x in enumerate(flat)]
    if tokens_m:  # [token, head] pairs -> movmatrix -> pb16[nt]: p8 of head g, tokens key_token(nt, 2t + 0 / 1)
      pb16 = [_movmatrix_t(_f16x2(p8[4 * mt + 2 * h], p8[4 * mt + 2 * h + 1])) for mt in range(2) for h in range(2)]
    else:
      pb16 = [_f16x2(p8[2 * nt], p8[2 * nt + 1]) for nt in range(4)]
    # B of the value sums (int8): tokens 4t..4t+3 (n-tiles 0, 1), 16+4t.. (2, 3): an f16 integer + 1024 holds it in
    # its low byte
    bias = ops.value(0x64006400)
    low = [_asm([i32], [x, bias], "add.rn.f16x2 $0, $1, $2;", "=r,r,r")[0] for x in pb16]
    packed = [_asm([i32], [low[2 * h], low[2 * h + 1]], "prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r")[0]
              for h in range(2)]
    ones = ops.value(0x01010101)
    l_i = _dp4a(packed[1], ones, _dp4a(packed[0], ones, l_i))

    # value sums: m-tile (p, half): channels p·Q + 16·half + 0..15
    new_acc = list(acc_i)
    for half in range(2):
      words = {}
      for hr in range(2):
        for ht in range(2):
          row, col = value_code_source(ops, half, hr, ht, warp, g, t)
          words[hr, ht], = _tiled_word(v_ref, 4, row, col, width=BLOCK_S, sw=128)
      for p in range(PLANES):
        a = [plane(words[0, 0], p), plane(words[1, 0], p), plane(words[0, 1], p), plane(words[1, 1], p)]
        mt = 2 * p + half
        new_acc[4 * mt:4 * mt + 4] = mma("m16n8k32", "s8", a, packed, acc_i[4 * mt:4 * mt + 4])
    acc_i = new_acc
    if outliers:  # value outliers: k-step st covers tokens 16·st + 4t + 0..3
      c = [acc_o[0], acc_o[1], zf, zf]
      for st in range(2):
        row, col = value_outlier_source(ops, st, warp, g, t)
        word, = _tiled_word(vo_ref, 4, row, col, width=BLOCK_S, sw=128)
        a = [_e4m3x2(word), zi, _e4m3x2(ops.shr(word, 16)), zi]
        c = mma("m16n8k16", "f16", a, [pb16[2 * st], pb16[2 * st + 1]], c)
      acc_o = c[:2]
    m_vals = ms if tokens_m else [ms[0], ms[0]]
    return (_fragment(acc_i, ACC_SHAPE, jnp.int32), _fragment([*m_vals, l_f, *acc_o, zf, zf, zf], MISC_SHAPE,
                                                              jnp.float32),
            _fragment([l_i, zi, zi, zi], LI_SHAPE, jnp.int32))

  return step


def acc_row(ops, ch):
  """Channel -> row of the wgmma core's ACC order (`oskvp_value_sums_mgpu.acc_rows` at Q = 32: channel
  [p2, p1, w, i] = [2, 2, 4, 8] -> row [p2, w, p1, i]), so that the output is `decode_core_splits`'s."""
  p2, p1 = ops.band(ch, 64), ops.band(ops.shr(ch, 5), 1)
  return ops.add(ops.add(p2, ops.shl(ops.band(ops.shr(ch, 3), 3), 4)), ops.add(ops.shl(p1, 3), ops.band(ch, 7)))


def _finish(outliers: bool, key_rows: str):
  """After the pipeline: the four warps' states merged by log-sum-exp into the program's output tiles in shared
  memory (o [H, 8] in ACC row order, ml [32]: m in [0, 8), l in [8, 16), oo [8 heads, 8 channels]), through x [64]
  (the warps' m and l) and five warpgroup barriers; the warps add their weighted sums into o and oo in turn."""
  wg = plgpu.Layout.WGMMA
  arg_types = (wg, wg, wg, plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), plgpu.RefType()) + \
      ((plgpu.RefType(),) if outliers else ())

  @plgpu.inline_mgpu(arg_types=arg_types)
  def finish(_, acc_i, misc, li, af_ref, o_ref, ml_ref, x_ref, *rest):
    ops, f32, index = rg.Mlir(), _f32(), ir.IndexType.get()
    as_index = lambda v: arith.index_cast(index, ops.value(v))
    warp, lane = rg.thread_coords(ops)
    g, t = ops.shr(lane, 2), ops.band(lane, 3)
    acc_i, misc, li = _scalars(acc_i), _scalars(misc), _scalars(li)
    l_f = misc[2]
    af_index = _flushed_index(warp, lane)
    total = [arith.addf(memref.load(af_ref, [af_index(i)]), arith.sitofp(f32, acc_i[i])) for i in range(32)]
    l = arith.addf(l_f, arith.sitofp(f32, li[0]))
    l = arith.addf(l, _shfl_bfly(l, 1))
    l = arith.addf(l, _shfl_bfly(l, 2))
    is_first = lambda v: arith.cmpi(arith.CmpIPredicate.eq, v, ops.value(0))

    def when(cond, fn):
      if_op = scf.IfOp(cond)
      with ir.InsertionPoint(if_op.then_block):
        fn()
        scf.yield_([])

    def publish_l():
      memref.store(l, x_ref, [as_index(ops.add(32, ops.add(ops.shl(warp, 3), g)))])
      if key_rows == "heads":
        memref.store(misc[0], x_ref, [as_index(ops.add(ops.shl(warp, 3), g))])

    def publish_m():  # "tokens": each thread holds the maxima of heads 2t, 2t + 1
      for e in range(2):
        memref.store(misc[e], x_ref, [as_index(ops.add(ops.shl(warp, 3), ops.add(ops.shl(t, 1), e)))])

    when(is_first(t), publish_l)
    if key_rows == "tokens":
      when(is_first(g), publish_m)
    mgpu.utils.warpgroup_barrier()

    def weight(head):  # (the program's max of head, this warp's weight 2^(m_w − max))
      ms = [memref.load(x_ref, [as_index(ops.add(8 * v, head))]) for v in range(WARPS)]
      top = functools.reduce(arith.maximumf, ms)
      return top, _ex2(arith.subf(memref.load(x_ref, [as_index(ops.add(ops.shl(warp, 3), head))]), top))

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

        when(is_first(t), head_sums)

      when(arith.cmpi(arith.CmpIPredicate.eq, warp, ops.value(v)), add)
      mgpu.utils.warpgroup_barrier()

  return finish


def _kernel(*refs, q_smem, qs_smem, af_smem, bar, qo_smem=None, steps: int, max_concurrent_steps: int, ablate: str,
            ragged: bool, outliers: bool, qo_width: int, key_rows: str):
  # kc_ref uint8 [BK, S, Q]; vc_ref uint8 [BK, Q, S]; qd_ref int8 [BK, 8, H]; qs_ref f32 [BK, 32] (scales, length at
  # 8); with outliers ko_ref fp8 [BK, S/8, 64], vo_ref fp8 [BK, 8, S], qo_ref f16 [BK, 8, 8 or 16]. acc_out f32
  # [BK, splits, H, 8] (ACC row order); ml_out f32 [BK, splits, 32]; acco_out f32 [BK, splits, 8, 8].
  if outliers:
    kc_ref, vc_ref, qd_ref, qs_ref, ko_ref, vo_ref, qo_ref, acc_out, ml_out, acco_out = refs
  else:
    kc_ref, vc_ref, qd_ref, qs_ref, acc_out, ml_out = refs
  bk, sp = jax.lax.axis_index("bk"), jax.lax.axis_index("split")
  plgpu.copy_gmem_to_smem(qd_ref.at[bk], q_smem, bar.at[0])
  plgpu.copy_gmem_to_smem(qs_ref.at[bk], qs_smem, bar.at[0])
  if outliers:
    plgpu.copy_gmem_to_smem(qo_ref.at[bk], qo_smem, bar.at[0])
  plgpu.barrier_wait(bar.at[0])
  tokens = pl.ds(sp * (steps * BLOCK_S), steps * BLOCK_S)
  blk = (lambda i: 0) if ablate == "l2_resident" else (lambda i: i)
  specs = [plgpu.BlockSpec((BLOCK_S, Q), lambda i: (blk(i), 0), transforms=ks.swizzled(Q)),
           plgpu.BlockSpec((Q, BLOCK_S), lambda i: (0, blk(i)), transforms=ks.swizzled(BLOCK_S))]
  srcs = [kc_ref.at[bk, tokens], vc_ref.at[bk, :, tokens]]
  if outliers:
    specs += [plgpu.BlockSpec((BLOCK_S // KO_TOKENS, KO_TOKENS * OUTLIERS), lambda i: (blk(i), 0)),
              plgpu.BlockSpec((OUTLIERS, BLOCK_S), lambda i: (0, blk(i)), transforms=ks.swizzled(BLOCK_S))]
    rows = steps * BLOCK_S // KO_TOKENS
    srcs += [ko_ref.at[bk, pl.ds(sp * rows, rows)], vo_ref.at[bk, :, tokens]]
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
  bk, s, q = dc._check_inputs(kcodes, vcodes, qd, qs, BLOCK_S, splits, max_concurrent_steps)  # pylint: disable=protected-access
  if q != Q:
    raise ValueError(f"code bytes per token Q={q}: decode_core_mma takes H = 128 (Q = {Q}) only")
  return bk, s, q


def _core_call(kcodes, vcodes, qd, qs_row, kout2=None, vout=None, qo=None, *, splits: int,
               max_concurrent_steps: int, ablate: str, ragged: bool, key_rows: str = KEY_ROW_DEFAULT):
  """The kernel on prepared inputs (`dc._core_call`'s, but kout2 fp8 [BK, S/8, 64] (eight tokens a row: TMA rows of
  64 bytes, not 16) and qo f16 [BK, 8, 8 or 16]) -> (acc f32 [BK, splits, H, 8] in
  ACC row order, ml f32 [BK, splits, 32], acco f32 [BK, splits, 8, 8] ([head, channel]) with outliers)."""
  bk, s, q = kcodes.shape
  outliers = kout2 is not None
  body = functools.partial(_kernel, steps=s // (splits * BLOCK_S), max_concurrent_steps=max_concurrent_steps,
                           ablate=ablate, ragged=ragged, outliers=outliers,
                           qo_width=qo.shape[-1] if outliers else 0, key_rows=key_rows)
  out_type = (jax.ShapeDtypeStruct((bk, splits, 4 * q, N), jnp.float32),
              jax.ShapeDtypeStruct((bk, splits, 32), jnp.float32))
  scratch = dict(q_smem=plgpu.SMEM((N, 4 * q), jnp.int8, transforms=ks.swizzled(128)),
                 qs_smem=plgpu.SMEM((dc.QS_SLOTS,), jnp.float32),
                 af_smem=plgpu.SMEM((FLUSHED,), jnp.float32),
                 bar=plgpu.Barrier(num_arrivals=3 if outliers else 2, num_barriers=1))
  args = (kcodes, vcodes, qd, qs_row)
  if outliers:
    out_type += (jax.ShapeDtypeStruct((bk, splits, N, OUTLIERS), jnp.float32),)
    scratch["qo_smem"] = plgpu.SMEM(qo.shape[1:], jnp.float16)
    args += (kout2, vout, qo)
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
  if qs_row.shape != (bk, dc.QS_SLOTS) or kout.shape != (bk, s, OUTLIERS) or vout.shape != (bk, OUTLIERS, s) \
      or qo16.shape != (bk, N, 2 * OUTLIERS):
    raise ValueError(f"qs_row {qs_row.shape}, kout {kout.shape}, vout {vout.shape}, qo16 {qo16.shape} must be "
                     f"[BK, 32], [BK, S, 8], [BK, 8, S], [BK, 8, 16] with BK={bk}, S={s}")
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
  if key_rows not in KEY_ROWS:
    raise ValueError(f"key_rows={key_rows!r} must be one of {KEY_ROWS}")
  outliers = kout is not None
  if (vout is not None) != outliers or (qo is not None) != outliers:
    raise ValueError("kout, vout and qo go together (all three or none)")
  if outliers and (kout.shape != (bk, s, OUTLIERS) or vout.shape != (bk, OUTLIERS, s) or qo.shape != (bk, N, OUTLIERS)):
    raise ValueError(f"kout {kout.shape}, vout {vout.shape}, qo {qo.shape} must be [BK, S, 8], [BK, 8, S], "
                     f"[BK, 8, 8] with BK={bk}, S={s}")
  qs_row = jnp.pad(qs, ((0, 0), (0, dc.QS_SLOTS - N)))
  if lengths is not None:
    qs_row = qs_row.at[:, dc.LEN_SLOT].set(jnp.clip(lengths, 0, s).astype(jnp.float32))
  extra = (kout.reshape(bk, s // KO_TOKENS, KO_TOKENS * OUTLIERS), vout, qo) if outliers else ()
  res = _core_call(kcodes, vcodes, qd, qs_row, *extra, splits=splits, max_concurrent_steps=max_concurrent_steps,
                   ablate=ablate, ragged=lengths is not None, key_rows=key_rows)
  mean, mean_o, lse2 = dc.merge_splits(res[0], res[1], res[2] if outliers else None)
  outs = (vs.channel_rows(mean, q, 2),) + ((mean_o,) if outliers else ()) + ((lse2,) if return_lse2 else ())
  return outs[0] if len(outs) == 1 else outs
