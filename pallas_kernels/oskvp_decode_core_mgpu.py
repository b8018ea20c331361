"""Feasibility prototype: the fused core of OS-KVP decode attention in Mosaic GPU, uniform codebooks (T = 1).

Joins the two building blocks (`oskvp_key_scores_mgpu.py`, `oskvp_value_sums_mgpu.py`) with an online softmax in
one kernel, to measure what the composed kernel costs per token-head (`benchmarks/notes_mgpu_oskvp.md` §9). The
2-bit codes, optionally the fp8 outlier channels (`kout`, `vout`, `qo`), ragged
lengths masked in the kernel (the capacity S a multiple of splits · block_s); no residual window (the caller merges
it by log-sum-exp: `moe_jax/kv_quant/oskvp_uniform_codes.py`); not wired into the attention op.

Per row b of the leading axis BK (batch row × kv head), with uniform codebooks cb[c] = c0 + d·c on both sides:

  s[n, t] = qs[n] · Σ_ch qd[n, ch] · kcode[t, ch]      (base-2 logits; qd = int8 digits of q·d_k, one per head n)
  p[n, t] = 2^(s[n, t] − max_t s[n, t]) / Σ_t 2^(...)
  out[n, ch] = Σ_t p[n, t] · vcode[t, ch]              (the caller applies c0_v + d_v · out, then U_vᵀ)

Up to N = 8 query heads per kv head (rows of qd beyond G are zero and their outputs ignored).

Kernel: grid (BK, splits), one warpgroup per program. The program loads qd [8, H] once and streams its S / splits
tokens as key code blocks uint8 [block_s, Q] and value code blocks uint8 [Q, block_s] (token-contiguous) through a
TMA ring (`plgpu.emit_pipeline`). Per block:
1. key scores: the codes themselves as int8 A (planes in registers, 4 per 64 tokens), qd as B: int32 [block_s, 8];
2. online softmax in f32 on the WGMMA layout: the block max per head (a reduction over the tokens, across the 4
   warps), p = 2^(s − m) quantized to int8 (p8 = round(127 p), 0..127), l += p8 elementwise (kept as [64, 8], the
   thread's row tiles folded; rescaled with the accumulator; reduced over the tokens once, at the end);
3. p8 stored transposed to shared memory [8, block_s] (K-major, the int8 wgmma B layout; byte stores with the
   swizzle applied by hand on the GPU route);
4. value sums: a fresh int32 [H, 8] accumulator = vcodes [H (ACC order), block_s] @ p8ᵀ (4 wgmmas per 64 tokens),
   added to the f32 accumulator after rescaling it by 2^(m_old − m_new).
With outliers (two more TMA streams: the key channels [S, 8] token-major as the cache stores them, the value
channels [8, S] tokens contiguous), step 1 adds an f16 wgmma whose A (the key tile, f16 [block_s, 16] with columns
8.. zero) is built in registers from 2-byte loads of the fp8 tile, and step 4 adds the value-outlier sums in one of
three forms (`value_outliers`), the same sums in each:
- "fp8": p8 split exactly into two e4m3 parts, p8 = hi + lo (`split_p8`), each stored transposed to shared memory
  as rows 0..7 of an A operand [64, block_s] (heads × tokens); two fp8 × fp8 wgmmas with the value tile as B, as
  TMA left it, give [64 (heads), 8 (channels)]. The running sums are rescaled per head along the rows, so alpha
  goes through shared memory once per block to come back as a row vector. No A fragment in registers.
- "fp8_stacked" (the default): the same, with lo in rows 8..15 of hi's A tile: one wgmma per 32 tokens gives the
  hi sums in rows 0..7 and the lo sums in rows 8..15 (added after the kernel); 8 KB less shared memory per program.
- "f16": an f16 wgmma whose A (the value tile repeated to 64 rows, [64, block_s]) is built from one 8-byte load
  per 32 tokens per thread (the tokens permuted along K so that a thread's columns are consecutive bytes), with p8
  as f16 ([8, block_s], stored transposed by hand with the same permutation).
On the H200 at 64k × batch 8 the fp8_stacked form at ring 2 is the fastest core (145.5 µs; fp8 151.3, f16 159.9 at
its best ring 3; results/oskvp_decode_core_mgpu_run13.md). Each side issues its wgmmas before one wait.
Outputs per program: acc f32 [H, 8], m f32 [8], l f32 [8]; `decode_core_mgpu` merges the splits (log-sum-exp) and
restores the channel order (`channel_rows`) in XLA and returns out f32 [BK, 8, H]; `decode_core_splits` returns the
per-split outputs as the kernel stores them, acc in ACC row order (for `oskvp_uniform_epilogue.epilogue`, which
reorders in its reads: a channel-order store in the kernel cost the core 10% at 64k × 8).

The GPU route's register-level pieces (hand-written transposed stores, the outlier A fragments and their index math)
are in `oskvp_core_registers_mgpu.py`. CPU interpret mode: the interpreter runs no inline Mosaic, so there the planes
go through shared memory (as in the building blocks) and p8 is stored with jnp.

`block_s=256` runs steps 1-3 in two passes of 128 tokens per pipeline step (one max per step, one fence) and step 4
once, the code planes a pass at a time; on the H200 it is no faster than 128 with outliers (146 registers: three
programs per SM instead of four) and 9% faster on codes alone (`benchmarks/notes_mgpu_oskvp.md` §20, §21).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.interpret_settle import settled_when_interpreted
from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels import oskvp_value_layout as vl
from pallas_kernels import oskvp_value_sums_mgpu as vs

N = 8  # query heads per kv head, padded: the wgmma N of both sides
OUTLIERS = rg.OUTLIERS  # fp8 outlier channels per side
# The value-outlier sums: fp8 × fp8 wgmmas from shared memory (p8's two e4m3 parts in two A tiles, or stacked in
# rows 0..7 and 8..15 of one), or the f16 A in registers.
VALUE_OUTLIER_FORMS = ("fp8", "fp8_stacked", "f16")
VALUE_OUTLIERS = "fp8_stacked"  # the default form: the fastest core on the H200 (results/..._run13.md)
P_LEVELS = 127.0  # p8 = round(127 · p), 0..127
SUB_BLOCK = 128  # tokens per key-score and softmax pass: a 256-token pipeline step runs two (`block_s=256`)
BLOCK_SIZES = (64, 128, 256)
L_ROWS = 64  # the running p8 sums per head are kept as [64, 8] (one wgmma M tile: 4 registers per thread)
MASKED = -1e30  # the score of a token past the row's length (finite: a fully masked block keeps alpha = 1)
QS_SLOTS = 32  # qs padded to a row of 128 bytes (what a TMA copy moves): the 8 scales, the length, zeros
LEN_SLOT = N  # qs's padded row carries the row's length (as f32, exact below 2^24) at this index


def valid_tokens(bk: int, s_len: int, lengths: jax.Array | None) -> jax.Array:
  """bool [BK, 1, S]: token t of row b is stored (t < lengths[b]; all tokens when lengths is None)."""
  if lengths is None:
    return jnp.ones((bk, 1, s_len), bool)
  return jnp.arange(s_len)[None, None, :] < lengths[:, None, None]


def _outlier_scores(kout: jax.Array | None, qo: jax.Array | None) -> jax.Array | float:
  """f32 [BK, 8, S] = Σ_c qo[n, c] · kout[t, c], or 0 without outliers."""
  if kout is None:
    return 0.0
  return jnp.einsum("btc,bnc->bnt", kout.astype(jnp.float32), qo.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("return_lse2",))
def decode_core_reference(kcodes: jax.Array, vcodes: jax.Array, qd: jax.Array, qs: jax.Array,
                          lengths: jax.Array | None = None, kout: jax.Array | None = None,
                          vout: jax.Array | None = None, qo: jax.Array | None = None, return_lse2: bool = False):
  """f32 reference: kcodes uint8 [BK, S, Q], vcodes uint8 [BK, Q, S], qd int8 [BK, 8, H], qs f32 [BK, 8],
  lengths int32 [BK] (optional) -> out f32 [BK, 8, H] = softmax_2(s) @ vcode over the first lengths[b] tokens
  (exact softmax, no quantization of p; zeros where a row has no token); kout, vout, qo as in `decode_core_mgpu`
  add the outlier scores and return (out, f32 [BK, 8, 8] value-outlier sums); return_lse2 appends
  lse2 f32 [BK, 8] = log2 Σ_t 2^s[n, t] (-inf for a row without tokens). Jitted; return_lse2 is static."""
  kc = ks.key_planes_reference(kcodes, 1).astype(jnp.float32)  # [BK, S, H] codes 0..3
  s = jnp.einsum("bth,bnh->bnt", kc, qd.astype(jnp.float32)) * qs[..., None] + _outlier_scores(kout, qo)
  valid = valid_tokens(*kcodes.shape[:2], lengths)
  s = jnp.where(valid, s, -jnp.inf)
  top = jnp.maximum(s.max(axis=-1, keepdims=True), MASKED)
  p = jnp.where(valid, jnp.exp2(s - top), 0.0)
  total = p.sum(axis=-1, keepdims=True)
  p = p / jnp.maximum(total, 1e-30)
  vc = vs.value_planes_reference(vcodes, 1).astype(jnp.float32)  # [BK, H, S]
  outs = (jnp.einsum("bnt,bht->bnh", p, vc),)
  if kout is not None:
    outs += (jnp.einsum("bnt,bot->bno", p, vout.astype(jnp.float32)),)
  if return_lse2:
    outs += (jnp.where(total[..., 0] > 0, top[..., 0] + jnp.log2(jnp.maximum(total[..., 0], 1e-30)), -jnp.inf),)
  return outs[0] if len(outs) == 1 else outs


@functools.partial(jax.jit, static_argnames=("block_s", "splits"))
def decode_core_blockwise_reference(kcodes: jax.Array, vcodes: jax.Array, qd: jax.Array, qs: jax.Array,
                                    lengths: jax.Array | None = None, kout: jax.Array | None = None,
                                    vout: jax.Array | None = None, qo: jax.Array | None = None, *, block_s: int,
                                    splits: int):
  """The kernel's own arithmetic in XLA: per split, blocks in order with the running max m_j (after block j),
  p8 = round(127 · 2^(s − m_j)), the block's sums weighed by 2^(m_j − m_final); splits merged by log-sum-exp.
  Same shapes as `decode_core_reference`; equal to the kernel up to f32 summation order. Jitted; block_s and splits
  are static."""
  bk, s_len, _ = kcodes.shape
  return blockwise_model(kcodes, vcodes, qd, qs, valid_tokens(bk, s_len, lengths), kout, vout, qo, block_s=block_s,
                         splits=splits)


def blockwise_model(kcodes, vcodes, qd, qs, valid, kout=None, vout=None, qo=None, *, block_s: int, splits: int):
  """`decode_core_blockwise_reference` with the stored tokens given as a mask, valid bool [BK, 1, S] (not jitted;
  for kernels whose blocks are not contiguous, which permute the tokens first)."""
  bk, s_len, _ = kcodes.shape
  kc = ks.key_planes_reference(kcodes, 1).astype(jnp.int32)
  s = jnp.einsum("bth,bnh->bnt", kc, qd.astype(jnp.int32)).astype(jnp.float32) * qs[..., None]  # [BK, 8, S]
  s = s + _outlier_scores(kout, qo)
  valid = jnp.broadcast_to(valid, s.shape)
  s = jnp.where(valid, s, MASKED)
  nb = s_len // (splits * block_s)
  s, valid = s.reshape(bk, N, splits, nb, block_s), valid.reshape(bk, N, splits, nb, block_s)
  m_run = jax.lax.cummax(jnp.maximum(s.max(axis=-1), MASKED), axis=3)  # [BK, 8, splits, nb]
  p8 = jnp.where(valid, jnp.floor(jnp.exp2(s - m_run[..., None]) * P_LEVELS + 0.5), 0.0)
  w = jnp.exp2(m_run - m_run[..., -1:])  # block j's weight at the end of its split
  vc = vs.value_planes_reference(vcodes, 1).astype(jnp.float32).reshape(bk, -1, splits, nb, block_s)
  acc = jnp.einsum("bnsj,bnsjt,bhsjt->bsnh", w, p8, vc)
  l = jnp.einsum("bnsj,bnsjt->bsn", w, p8)
  m = m_run[..., -1].transpose(0, 2, 1)  # [BK, splits, 8]
  ws = jnp.exp2(m - m.max(axis=1, keepdims=True))
  total = jnp.maximum(jnp.einsum("bsn,bsn->bn", ws, l), 1e-30)[..., None]
  out = jnp.einsum("bsn,bsnh->bnh", ws, acc) / total
  if kout is None:
    return out
  vo = vout.astype(jnp.float32).reshape(bk, OUTLIERS, splits, nb, block_s)
  acc_o = jnp.einsum("bnsj,bnsjt,bosjt->bsno", w, p8, vo)
  return out, jnp.einsum("bsn,bsno->bno", ws, acc_o) / total


def split_p8(p8):
  """int32 p8 (0..127, any shape and layout) -> (hi, lo) float8_e4m3fn with hi + lo = p8 exactly: hi = p8 rounded to
  e4m3 (4 significant bits), lo = p8 − hi (|lo| <= 4, an integer, exact in e4m3). The fp8 form of the value-outlier
  sums multiplies both by the fp8 value-outlier tile on the tensor cores, so its sums equal the f16 form's."""
  pf = p8.astype(jnp.float32)
  hi = pf.astype(jnp.float8_e4m3fn)
  return hi, (pf - hi.astype(jnp.float16).astype(jnp.float32)).astype(jnp.float8_e4m3fn)


def copy_row_inputs(bk, bar, *pairs) -> None:
  """Inside a core's kernel: row bk of each (gmem ref, smem ref) pair (the query digits, the scale row, the
  key-outlier query) copied to shared memory on one barrier, and waited for."""
  for src, dst in pairs:
    plgpu.copy_gmem_to_smem(src.at[bk], dst, bar.at[0])
  plgpu.barrier_wait(bar.at[0])


def _kernel(*refs, q_smem, qs_smem, p_smem, bar, ka_smem=None, va_smem=None, qo_smem=None, a16_smem=None,
            vt_smem=None, p16_smem=None, ph_smem=None, pl_smem=None, block_s: int,
            steps: int, max_concurrent_steps: int, interpret: bool, ablate: str, ragged: bool, outliers: bool,
            value_outliers: str, value_blocks: bool):
  # kc_ref uint8 [BK, S, Q]; vc_ref uint8 [BK, Q, S] (value_blocks: [BK, S/128 · Q, 128], `vl.ring_operand`; vo_ref
  # likewise [BK, S/128 · 8, 128]); qd_ref int8 [BK, 8, H]; qs_ref f32 [BK, 32] (the 8 scales,
  # padded: TMA copies move multiples of 128 bytes); with outliers also ko_ref fp8 [BK, S/2, 16] (the key outlier
  # channels [S, 8] seen as rows of two tokens: TMA boxes need 16-byte rows), vo_ref fp8 [BK, 8, S] (the value
  # outlier channels, tokens contiguous) and qo_ref f16 [BK, 8, 16] (the key-outlier query in base-2 logits;
  # columns 8.. zero). acc_out f32 [BK, splits, H, 8] (ACC row order);
  # ml_out f32 [BK, splits, 32]: m in [0, 8), l in [8, 16); acco_out f32 [BK, splits, 8 or 16 · passes, 8]
  # (value-outlier sums: [head, channel] in the fp8 forms, with fp8_stacked rows 16i..16i+7 pass i's hi part's and
  # 16i+8.. its lo part's; [channel, head] in f16). A pipeline step of block_s tokens runs block_s / sub passes of
  # sub = min(block_s, 128) tokens (key scores, p8) and one fence and one set of value wgmmas.
  # q_smem int8 [8, H]; qs_smem f32 [32 (+128)]: qs_ref's row, then with fp8 value outliers alpha per head as a row
  # vector in two slots of 64 by block parity (one allocation: each takes 1 KB, aligned); ka_smem int8 [sub, H] /
  # va_smem int8 [H, block_s] (planes through shared memory, interpret mode only); p_smem int8 [8, block_s].
  # Outliers: qo_smem f16 [8, 16]; a16_smem f16 [sub, 16] / vt_smem f16 [64, block_s] (the outlier A operands,
  # interpret mode only: the GPU route builds them in registers, `rg.key_outlier_fragment`,
  # `rg.value_outlier_fragment`); p16_smem f16 [8, block_s] (p8 as f16; on the GPU route its columns permuted as the
  # value A's, `rg.token_to_k`). value_outliers="fp8" instead of vt_smem, p16_smem: ph_smem, pl_smem fp8 [64, sub]
  # (rows 0..7: p8 = hi + lo, both exact in e4m3, `split_p8`; rows 8.. never written: their sums, in the rows of
  # acc_o past 8, are never read); "fp8_stacked": ph_smem only, hi in rows 0..7 and lo in rows 8..15 (16i.. for
  # pass i; one wgmma per pass; the parts summed outside). The output buffers (o [H, 8], ml [32], oo [64, 8], f32)
  # are scoped after the pipeline, in the ring's memory.
  if outliers:
    kc_ref, vc_ref, qd_ref, qs_ref, ko_ref, vo_ref, qo_ref, acc_out, ml_out, acco_out = refs
  else:
    kc_ref, vc_ref, qd_ref, qs_ref, acc_out, ml_out = refs
  bk, sp = jax.lax.axis_index("bk"), jax.lax.axis_index("split")
  copy_row_inputs(bk, bar, (qd_ref, q_smem), (qs_ref, qs_smem.at[pl.ds(0, QS_SLOTS)]),
                  *([(qo_ref, qo_smem)] if outliers else []))
  q = kc_ref.shape[-1]
  h = 4 * q
  col = plgpu.Layout.WGMMA.reduce(0)  # an [8] vector broadcast along the rows of a WGMMA-layout array
  qs = plgpu.load(qs_smem.at[pl.ds(0, N)], layout=col)
  tokens = pl.ds(sp * (steps * block_s), steps * block_s)
  # ablate="l2_resident": every step loads the split's first blocks again (served by L2 after the first), so the
  # kernel runs its full compute with almost no DRAM traffic: the compute side's own time.
  blk = (lambda i: 0) if ablate == "l2_resident" else (lambda i: i)
  k_spec = plgpu.BlockSpec((block_s, q), lambda i: (blk(i), 0), transforms=ks.swizzled(q))
  ko_spec = plgpu.BlockSpec((block_s // 2, 2 * OUTLIERS), lambda i: (blk(i), 0))
  v_spec, v_src = vl.ring_source(vc_ref, q, bk, sp, steps, block_s, blk, blocks=value_blocks)

  n_valid = qs_smem[LEN_SLOT].astype(jnp.int32)

  sub = min(block_s, SUB_BLOCK)  # tokens per key-score and softmax pass
  passes = block_s // sub  # passes per pipeline step (2 at block_s = 256)
  fp8_form = outliers and value_outliers.startswith("fp8")
  fp8_values = fp8_form and ablate != "no_outlier_value"
  stacked = value_outliers == "fp8_stacked"
  lo_smem, lo_row = (ph_smem, N) if stacked else (pl_smem, 0)  # where p8's low part goes (pass 0)

  def key_scores(k_smem, ko_tile):  # k_smem [sub, Q], ko_tile [sub / 2, 16] -> f32 [sub, 8] base-2 logits (WGMMA)
    scale = jax.lax.broadcast_in_dim(qs, (sub, N), [1])
    if not outliers or ablate == "no_outlier_key":
      s_i32 = ks.block_scores(k_smem, q_smem, ka_smem, n=N, plane_types=1, a_operand="registers",
                              interpret=interpret)
      return s_i32.astype(jnp.float32) * scale

    def scope(acc_i, acc_o):  # int32 [sub, 8] code scores; f32 [sub, 8] key-outlier scores
      if interpret:
        ka_smem[...] = ks.key_planes_reference(k_smem[...], 1)
        a16_smem[...] = jnp.pad(ko_tile[...].reshape(sub, OUTLIERS).astype(jnp.float16), ((0, 0), (0, OUTLIERS)))
        plgpu.commit_smem()
        plgpu.wgmma(acc_i, ka_smem, q_smem.T)
        plgpu.wgmma(acc_o, a16_smem, qo_smem.T)
      else:
        codes = plgpu.load(k_smem, layout=plgpu.Layout.WGMMA_8BIT)
        plgpu.wgmma(acc_i, ks.planes_in_registers(codes, sub, q, 1), q_smem.T)
        plgpu.wgmma(acc_o, rg.key_outlier_fragment(ko_tile, sub), qo_smem.T)
      plgpu.wgmma_wait(0)
      return acc_i[...].astype(jnp.float32) * scale + acc_o[...]

    return pl.run_scoped(scope, plgpu.ACC((sub, N), jnp.int32), plgpu.ACC((sub, N), jnp.float32))

  def pass_view(ref, i, size, axis=0):  # pass i's rows (or columns) of a step's tile (the tile at one pass per step)
    if passes == 1:
      return ref
    return ref.at[pl.ds(i * size, size)] if axis == 0 else ref.at[:, pl.ds(i * size, size)]

  def body(idx, k_smem, v_smem, *rest):
    ko_tile, vo_tile, carry = rest if outliers else (None, None, rest[0])
    if ablate == "no_compute":  # the TMA ring alone: the kernel's memory-side ceiling
      return carry
    m, l, acc, acc_o = carry  # f32 [8] (col); [sub, 8] per-token p8 sums; [H, 8]; [64, 8] or None
    scores = []  # per pass: f32 [sub, 8]
    for i in range(passes):
      s = key_scores(pass_view(k_smem, i, sub), None if ko_tile is None else pass_view(ko_tile, i, sub // 2))
      if ragged:  # tokens at or past the row's length score MASKED; only a pass reaching past it pays for the mask
        first = (sp * steps + idx[0]) * block_s + i * sub

        def mask(s, first=first):
          valid = plgpu.broadcasted_iota(jnp.int32, (sub, N), 0, layout=plgpu.Layout.WGMMA) + first < n_valid
          return jnp.where(valid, s, MASKED)

        s = jax.lax.cond(first + sub > n_valid, mask, lambda s: s, s)
      scores.append(s)
    # ablate (timing experiments only, wrong results): "no_max" skips the block max, "no_value" the value wgmmas,
    # "no_outlier_key" / "no_outlier_value" the outlier work of one side (their tiles are still loaded).
    # The passes' maxima elementwise first: one reduction across the warps per step.
    m_new = m if ablate == "no_max" else jnp.maximum(m, jnp.max(functools.reduce(jnp.maximum, scores), axis=0))
    alpha = jnp.exp2(m - m_new)
    # While a split has seen no stored token (m_new = MASKED), p must be 0, not 2^0: subtract +inf instead.
    m_p = jnp.where(m_new > 0.5 * MASKED, m_new, jnp.inf) if ragged else m_new
    if fp8_values:
      slot = qs_smem.at[pl.ds(QS_SLOTS + 64 * (idx[0] % 2), 64)]  # alpha's slot of this block's parity
      for r in range(2 * passes if stacked else 1):
        slot[pl.ds(r * N, N)] = alpha
    l = l * jax.lax.broadcast_in_dim(alpha, (L_ROWS, N), [1])  # summed over rows at the end
    p8s = []
    for i, s in enumerate(scores):  # pass by pass: one pass's p8 and its e4m3 parts live at a time
      p8 = (jnp.exp2(s - jax.lax.broadcast_in_dim(m_p, (sub, N), [1])) * P_LEVELS + 0.5).astype(jnp.int32)
      pf = p8.astype(jnp.float32)
      for r in range(0, sub, L_ROWS):  # the thread's own rows folded: no data moves
        l = l + pf[r:r + L_ROWS]
      if interpret:
        p8s.append(p8)
        continue
      rg.store_transposed(p8, p_smem, ks.swizzled(block_s), column_offset=i * sub)
      if fp8_values:  # hi, lo of pass i in rows 2·8·i + (0..7, 8..15) of the stacked tile
        hi, lo = split_p8(p8)
        rg.store_transposed(hi, ph_smem, ks.swizzled(sub), row_offset=2 * N * i)
        rg.store_transposed(lo, lo_smem, ks.swizzled(sub), row_offset=lo_row + 2 * N * i)
      elif outliers and ablate != "no_outlier_value":  # one pass per step (block_s <= 128)
        rg.store_transposed(p8.astype(jnp.float16), p16_smem, rg.F16_T_TRANSFORMS, column_map=rg.token_to_k)
    if interpret:
      p_smem[...] = jnp.concatenate([p8.T for p8 in p8s], axis=1).astype(jnp.int8)
      va_smem[...] = vs.acc_rows(vs.value_planes_reference(v_smem[...], 1), q, 0)
      if fp8_values:
        for i, p8 in enumerate(p8s):
          hi, lo = split_p8(p8)
          ph_smem[pl.ds(2 * N * i, N), :] = hi.T
          lo_smem[pl.ds(lo_row + 2 * N * i, N), :] = lo.T
      elif outliers and not fp8_form:
        p16_smem[...] = p8s[0].T.astype(jnp.float16)
        vt_smem[...] = jnp.tile(vo_tile[...].astype(jnp.float16), (64 // OUTLIERS, 1))
    plgpu.commit_smem()
    if fp8_values:  # after the barrier: every thread's alpha is in; the other slot is the next block's
      alpha_rows = plgpu.load(slot, layout=plgpu.Layout.WGMMA.reduce(1))  # [64]; only the written rows are used

    def value_scope(vacc_ref):  # int32 [H, 8]: this block's code sums
      if interpret:
        plgpu.wgmma(vacc_ref, va_smem, p_smem.T)
      else:  # the code planes a pass at a time: a pass's planes (32 registers) are retired before the next pass's are
        # built (both at once: 158 registers at block 256)
        for i in range(passes):
          if i:
            plgpu.wgmma_wait(0)
          codes = plgpu.load(pass_view(v_smem, i, sub, axis=1), layout=vs.CODE_LAYOUT_PL)
          planes = vs.planes_in_registers(codes, sub, q, 1)
          plgpu.wgmma(vacc_ref, planes, pass_view(p_smem, i, sub, axis=1).T)
      if not outliers:
        plgpu.wgmma_wait(0)
        return vacc_ref[...]
      # The outlier sums last, in their own scope: their accumulators (and the zeros they start from) are not live
      # while the planes are built.
      return pl.run_scoped(functools.partial(outlier_scope, vacc_ref),
                           *[plgpu.ACC((64, N), jnp.float32)] * (passes if fp8_values else 1))

    def outlier_scope(vacc_ref, *oacc_refs):  # f32 [64, 8] outlier sums per pass (one outside fp8_values)
      oacc_ref = oacc_refs[0]
      if fp8_values:  # [64 (heads), 8 (channels)] = p8 [heads, tokens] @ vout [channels, tokens]ᵀ, fp8 × fp8
        # stacked: rows 0..7 hi, rows 8..15 lo (summed after the kernel); pass i's tokens against rows 16i..16i+15
        for i, oacc_i in enumerate(oacc_refs):
          plgpu.wgmma(oacc_i, ph_smem, pass_view(vo_tile, i, sub, axis=1).T)
        if not stacked:
          plgpu.wgmma(oacc_ref, pl_smem, vo_tile.T)
      elif fp8_form:
        pass  # ablated
      elif interpret:
        plgpu.wgmma(oacc_ref, vt_smem, p16_smem.T)
      elif ablate != "no_outlier_value":
        plgpu.wgmma(oacc_ref, rg.value_outlier_fragment(vo_tile, block_s, ks.swizzled(block_s)), p16_smem.T)
      plgpu.wgmma_wait(0)
      sums_o = oacc_ref[...]
      for i in range(1, len(oacc_refs)):  # rows 16i.. of pass i's sums
        row = plgpu.broadcasted_iota(jnp.int32, (64, N), 0, layout=plgpu.Layout.WGMMA)
        sums_o = jnp.where(row >= 2 * N * i, oacc_refs[i][...], sums_o)
      return vacc_ref[...], sums_o

    if ablate == "no_value":
      return m_new, l, acc, acc_o
    if outliers:
      sums, sums_o = pl.run_scoped(value_scope, plgpu.ACC((h, N), jnp.int32))
      if fp8_values:  # rows are heads: [head, channel]
        acc_o = acc_o * jax.lax.broadcast_in_dim(alpha_rows, (64, N), [0]) + sums_o
      elif not fp8_form:  # rows are channels (repeated 8 times): [channel, head]
        acc_o = acc_o * jax.lax.broadcast_in_dim(alpha, (64, N), [1]) + sums_o
    else:
      sums = pl.run_scoped(value_scope, plgpu.ACC((h, N), jnp.int32))
    acc = acc * jax.lax.broadcast_in_dim(alpha, (h, N), [1]) + sums.astype(jnp.float32)
    return m_new, l, acc, acc_o

  init = (plgpu.layout_cast(jnp.full((N,), 0.0 if ablate == "no_max" else MASKED, jnp.float32), col),
          plgpu.layout_cast(jnp.zeros((L_ROWS, N), jnp.float32), plgpu.Layout.WGMMA),
          plgpu.layout_cast(jnp.zeros((h, N), jnp.float32), plgpu.Layout.WGMMA),
          plgpu.layout_cast(jnp.zeros((64, N), jnp.float32), plgpu.Layout.WGMMA) if outliers else None)
  specs, srcs = [k_spec, v_spec], [kc_ref.at[bk, tokens], v_src]
  if outliers:
    vo_spec, vo_src = vl.ring_source(vo_ref, OUTLIERS, bk, sp, steps, block_s, blk, blocks=value_blocks)
    specs += [ko_spec, vo_spec]
    srcs += [ko_ref.at[bk, pl.ds(sp * (steps * block_s // 2), steps * block_s // 2)], vo_src]
  m, l, acc, acc_o = plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs,
                                         max_concurrent_steps=max_concurrent_steps, init_carry=init)(*srcs)

  def store(o_smem, ml_smem, oo_smem=None):  # after the pipeline: these buffers take the ring's shared memory
    o_smem[...] = acc  # ACC row order: the reader reorders (a channel-order store by hand cost the core 10%)
    ml_smem[pl.ds(0, N)] = m
    ml_smem[pl.ds(N, N)] = jnp.sum(l, axis=0)
    zero = plgpu.layout_cast(jnp.zeros((N,), jnp.float32), col)  # the row's unused tail (as the mma core)
    ml_smem[pl.ds(2 * N, N)] = zero
    ml_smem[pl.ds(3 * N, N)] = zero
    if outliers:
      oo_smem[...] = acc_o
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, acc_out.at[bk, sp])
    plgpu.copy_smem_to_gmem(ml_smem, ml_out.at[bk, sp])
    if outliers:
      plgpu.copy_smem_to_gmem(oo_smem.at[pl.ds(0, acco_out.shape[2])], acco_out.at[bk, sp])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(store, plgpu.SMEM((h, N), jnp.float32), plgpu.SMEM(ml_out.shape[-1:], jnp.float32),
                *([plgpu.SMEM((64, N), jnp.float32)] if outliers else []))


def _check_inputs(kcodes, vcodes, qd, qs, block_s, splits, max_concurrent_steps):
  """Validates the arguments (vcodes tokens contiguous or block-major, `oskvp_value_layout`); returns (BK, S, Q)."""
  if kcodes.ndim != 3 or vcodes.ndim not in (3, 4) or qd.ndim != 3 or qs.ndim != 2:
    raise ValueError(f"need kcodes [BK, S, Q] {kcodes.shape}, vcodes [BK, Q, S] or [BK, S/128, Q, 128] "
                     f"{vcodes.shape}, qd [BK, 8, H] {qd.shape}, qs [BK, 8] {qs.shape}")
  if kcodes.dtype != jnp.uint8 or vcodes.dtype != jnp.uint8 or qd.dtype != jnp.int8 or qs.dtype != jnp.float32:
    raise TypeError(f"kcodes, vcodes must be uint8, qd int8 and qs float32; got {kcodes.dtype}, {vcodes.dtype}, "
                    f"{qd.dtype}, {qs.dtype}")
  bk, s, q = kcodes.shape
  if vl.check_value_operand(vcodes, "vcodes", bk, q, s) and block_s != vl.BLOCK:
    raise ValueError(f"block_s={block_s}: block-major vcodes take {vl.BLOCK}-token steps")
  if qd.shape != (bk, N, 4 * q) or qs.shape != (bk, N):
    raise ValueError(f"qd {qd.shape} must be [BK, {N}, H={4 * q}] and qs {qs.shape} [BK, {N}]")
  if q % 32:
    raise ValueError(f"code bytes per token Q={q} must be a multiple of 32 (H a multiple of 128)")
  if block_s not in BLOCK_SIZES:
    raise ValueError(f"block_s={block_s!r} must be one of {BLOCK_SIZES}")
  ks.check_loop_args(s, block_s, splits, max_concurrent_steps)
  return bk, s, q


def _core_call(kcodes, vcodes, qd, qs_row, kout2=None, vout=None, qo16=None, *, block_s: int, splits: int,
               max_concurrent_steps: int, interpret, ablate: str = "", ragged: bool,
               value_outliers: str = VALUE_OUTLIERS):
  """The kernel on prepared inputs: qs_row f32 [BK, 32] (the 8 scales, the length at index 8), kout2 fp8
  [BK, S/2, 16], vout fp8 [BK, 8, S], qo16 f16 [BK, 8, 16] -> (acc f32 [BK, splits, H, 8] (ACC row order), ml f32
  [BK, splits, 32] (+ acco f32 [BK, splits, P, 8, 8] with outliers: the value-outlier sums as [head, channel] in P
  parts to be summed, 2 per pass for "fp8_stacked" (p8's e4m3 hi and lo parts; 4 at block_s=256), else 1)).
  vcodes and vout: both tokens contiguous or both block-major (`oskvp_value_layout`)."""
  bk, s, q = kcodes.shape
  h = 4 * q
  steps = s // (splits * block_s)
  outliers = kout2 is not None
  value_blocks = check_value_layouts(vcodes, vout)
  if value_outliers not in VALUE_OUTLIER_FORMS:
    raise ValueError(f"value_outliers={value_outliers!r} must be one of {VALUE_OUTLIER_FORMS}")
  fp8_values = outliers and value_outliers.startswith("fp8")
  stacked = outliers and value_outliers == "fp8_stacked"
  sub = min(block_s, SUB_BLOCK)
  if outliers and block_s > sub and not stacked:
    raise ValueError(f"block_s={block_s} (two passes per step) takes value_outliers='fp8_stacked' only, "
                     f"not {value_outliers!r}")
  body = functools.partial(_kernel, block_s=block_s, steps=steps, max_concurrent_steps=max_concurrent_steps,
                           interpret=bool(interpret), ablate=ablate, ragged=ragged, outliers=outliers,
                           value_outliers=value_outliers, value_blocks=value_blocks)
  smem_a = interpret  # planes and outlier A tiles through shared memory only in the interpreter (one 8-row tile of
  # each on the GPU route, never touched: 26 KB less shared memory per program with outliers at block 128)
  kernel = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((bk, splits, h, N), jnp.float32),
                jax.ShapeDtypeStruct((bk, splits, 32), jnp.float32))
      + ((jax.ShapeDtypeStruct((bk, splits, 2 * OUTLIERS * (block_s // sub) if stacked else OUTLIERS, N),
                                jnp.float32),)
         if outliers else ()),
      grid=(bk, splits), grid_names=("bk", "split"),
      scratch_types=dict(
          q_smem=plgpu.SMEM((N, h), jnp.int8, transforms=ks.swizzled(128)),
          # the scales and the length; alpha's two slots after them with fp8 value outliers (one 1 KB allocation)
          qs_smem=plgpu.SMEM((QS_SLOTS + (2 * 64 if fp8_values else 0),), jnp.float32),
          **(dict(ka_smem=plgpu.SMEM((sub, h), jnp.int8, transforms=ks.swizzled(128)),
                  va_smem=plgpu.SMEM((h, block_s), jnp.int8, transforms=ks.swizzled(block_s))) if smem_a else {}),
          p_smem=plgpu.SMEM((N, block_s), jnp.int8, transforms=ks.swizzled(block_s)),
          bar=plgpu.Barrier(num_arrivals=3 if outliers else 2, num_barriers=1),
          **(dict(qo_smem=plgpu.SMEM((N, 2 * OUTLIERS), jnp.float16, transforms=rg.F16_B16_TRANSFORMS),
                  **(dict(a16_smem=plgpu.SMEM((sub, 2 * OUTLIERS), jnp.float16, transforms=rg.F16_B16_TRANSFORMS))
                     if smem_a else {})) if outliers else {}),
          **(dict(ph_smem=plgpu.SMEM((64, sub), jnp.float8_e4m3fn, transforms=ks.swizzled(sub)),
                  **({} if stacked else dict(pl_smem=plgpu.SMEM((64, block_s), jnp.float8_e4m3fn,
                                                                transforms=ks.swizzled(block_s))))) if fp8_values else
             dict(vt_smem=plgpu.SMEM((64, block_s) if smem_a else (8, 64), jnp.float16, transforms=rg.F16_T_TRANSFORMS),
                  p16_smem=plgpu.SMEM((N, block_s), jnp.float16, transforms=rg.F16_T_TRANSFORMS)) if outliers else {})),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **ks.interpret_kwargs(interpret))
  res = kernel(kcodes, vl.ring_operand(vcodes), qd, qs_row,
               *((kout2, vl.ring_operand(vout), qo16) if outliers else ()))
  if outliers:  # every form returns parts × [head, channel]: the fp8 forms as stored (free reshapes), f16 transposed
    acco = res[2] if fp8_values else jnp.swapaxes(res[2], -1, -2)
    res = (*res[:2], acco.reshape(bk, splits, -1, N, OUTLIERS))
  return res


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=("block_s", "splits", "max_concurrent_steps", "interpret",
                                             "value_outliers"))
def decode_core_splits(kcodes: jax.Array, vcodes: jax.Array, qd: jax.Array, qs_row: jax.Array, kout: jax.Array,
                       vout: jax.Array, qo16: jax.Array, *, block_s: int = 128, splits: int = 16,
                       max_concurrent_steps: int = 2, interpret: bool | plgpu.InterpretGPUParams = False,
                       value_outliers: str = VALUE_OUTLIERS):
  """The core with outliers and ragged lengths, unmerged: for callers that merge the splits themselves
  (`oskvp_uniform_epilogue.epilogue`, which also takes the window).

  Args:
    kcodes, vcodes, qd, kout, vout: as in `decode_core_mgpu`.
    qs_row: f32 [BK, 32]: the 8 per-head scales of `decode_core_mgpu`'s qs, the row's length (tokens stored, as f32)
      at index 8, zeros elsewhere (`oskvp_uniform_prologue.prologue` writes it).
    qo16: f16 [BK, 8, 16]: `decode_core_mgpu`'s qo with 8 zero columns appended (the f16 wgmma's K).

  Returns:
    (acc f32 [BK, splits, H, 8] = Σ_t p8[n, t] · vcode[t, ch] per split (ACC row order,
    `oskvp_value_sums_mgpu.acc_row_channels`; relative to 2^m),
    ml f32 [BK, splits, 32]: m (the split's running max, base-2 logits) in [0, 8), l = Σ_t p8 in [8, 16), zeros
    in [16, 32),
    acco f32 [BK, splits, P, 8, 8]: Σ_t p8[n, t] · vout[o, t] as [n, o], the sum of its P parts (2 for
    "fp8_stacked", 4 at block_s=256, else 1), left unsummed for the reader); p8 = round(127 · 2^(s − m)).
  """
  bk, s, q = _check_inputs(kcodes, vcodes, qd, qs_row[:, :N], block_s, splits, max_concurrent_steps)
  check_split_inputs(bk, s, qs_row, kout, vout, qo16)
  return _core_call(kcodes, vcodes, qd, qs_row, kout.reshape(bk, s // 2, 2 * OUTLIERS), vout, qo16,
                    block_s=block_s, splits=splits, max_concurrent_steps=max_concurrent_steps, interpret=interpret,
                    ragged=True, value_outliers=value_outliers)


def check_optional_inputs(bk: int, s: int, lengths, kout, vout, qo) -> bool:
  """`decode_core_mgpu`'s optional arguments checked (errors name the field); returns whether outliers are given."""
  if lengths is not None and (lengths.shape != (bk,) or not jnp.issubdtype(lengths.dtype, jnp.integer)):
    raise ValueError(f"lengths {lengths.shape} {lengths.dtype} must be integer [BK={bk}]")
  outliers = kout is not None
  if (vout is not None) != outliers or (qo is not None) != outliers:
    raise ValueError("kout, vout and qo go together (all three or none)")
  if outliers and (kout.shape != (bk, s, OUTLIERS) or kout.dtype != jnp.float8_e4m3fn):
    raise ValueError(f"kout {kout.shape} {kout.dtype} must be float8_e4m3fn [BK, S, {OUTLIERS}] = {(bk, s, OUTLIERS)}")
  if outliers and vout.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"vout is {vout.dtype}, must be float8_e4m3fn")
  if outliers:
    vl.check_value_operand(vout, "vout", bk, OUTLIERS, s)
  if outliers and (qo.shape != (bk, N, OUTLIERS) or qo.dtype != jnp.float16):
    raise ValueError(f"qo {qo.shape} {qo.dtype} must be float16 [BK, {N}, {OUTLIERS}]")
  return outliers


def check_split_inputs(bk: int, s: int, qs_row, kout, vout, qo16) -> None:
  """`decode_core_splits`'s prepared arguments checked (shapes and dtypes; errors name the field)."""
  if qs_row.shape != (bk, QS_SLOTS) or kout.shape != (bk, s, OUTLIERS) or qo16.shape != (bk, N, 2 * OUTLIERS):
    raise ValueError(f"qs_row {qs_row.shape}, kout {kout.shape}, qo16 {qo16.shape} must be "
                     f"[BK, 32], [BK, S, 8], [BK, 8, 16] with BK={bk}, S={s}")
  vl.check_value_operand(vout, "vout", bk, OUTLIERS, s)
  for name, x, dtype in (("qs_row", qs_row, jnp.float32), ("kout", kout, jnp.float8_e4m3fn),
                         ("vout", vout, jnp.float8_e4m3fn), ("qo16", qo16, jnp.float16)):
    if x.dtype != dtype:
      raise ValueError(f"{name} is {x.dtype}, must be {jnp.dtype(dtype).name}")


def check_value_layouts(vcodes: jax.Array, vout: jax.Array | None) -> bool:
  """Whether the (checked) value operands are block-major; vout, where given, must share vcodes' layout."""
  if vout is not None and vout.ndim != vcodes.ndim:
    raise ValueError(f"vout {vout.shape} and vcodes {vcodes.shape} must share a layout: both tokens contiguous "
                     "or both block-major")
  return vcodes.ndim == 4


def padded_scales(qs: jax.Array, lengths: jax.Array | None, s: int) -> jax.Array:
  """qs f32 [BK, 8] -> the kernels' qs_row f32 [BK, 32]: the scales, the row's length (clipped to S, as f32) at
  LEN_SLOT when lengths are given, zeros elsewhere."""
  qs_row = jnp.pad(qs, ((0, 0), (0, QS_SLOTS - N)))  # the length rides in the padding
  if lengths is not None:
    qs_row = qs_row.at[:, LEN_SLOT].set(jnp.clip(lengths, 0, s).astype(jnp.float32))
  return qs_row


def merge_splits(acc: jax.Array, ml: jax.Array, acco: jax.Array | None = None):
  """The core's per-split outputs merged by log-sum-exp (XLA): acc f32 [..., S, R, 8], ml f32 [..., S, 32] (m, l),
  acco f32 [..., S, 8, 8] ([head, outlier channel]) or None -> (mean f32 [..., 8, R] = Σ_s w_s acc_s / Σ_s w_s l_s,
  mean_o f32 [..., 8, 8] (the same for acco, [head, outlier channel]) or None, lse2 f32 [..., 8] = log2 Σ_t 2^s
  (-inf without tokens)), with w_s = 2^(m_s − max_s m_s)."""
  m, l = ml[..., :N], ml[..., N:2 * N]
  top = m.max(axis=-2, keepdims=True)
  w = jnp.exp2(m - top)  # [..., S, 8]
  total = jnp.einsum("...sn,...sn->...n", w, l)  # Σ p8 relative to 2^top
  denom = jnp.maximum(total, 1e-30)[..., None]
  mean = jnp.einsum("...sn,...shn->...nh", w, acc) / denom
  mean_o = None if acco is None else jnp.einsum("...sn,...sno->...no", w, acco) / denom
  lse2 = jnp.where(total > 0, top[..., 0, :] + jnp.log2(jnp.maximum(total, 1e-30) / P_LEVELS), -jnp.inf)
  return mean, mean_o, lse2


ABLATIONS = ("", "no_max", "no_value", "no_outlier_key", "no_outlier_value", "no_compute", "l2_resident")


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=("block_s", "splits", "max_concurrent_steps", "interpret", "ablate",
                                             "return_lse2", "value_outliers"))
def decode_core_mgpu(kcodes: jax.Array, vcodes: jax.Array, qd: jax.Array, qs: jax.Array,
                     lengths: jax.Array | None = None, kout: jax.Array | None = None,
                     vout: jax.Array | None = None, qo: jax.Array | None = None, *,
                     block_s: int = 64, splits: int = 16,
                     max_concurrent_steps: int = 4,
                     interpret: bool | plgpu.InterpretGPUParams = False, ablate: str = "",
                     return_lse2: bool = False, value_outliers: str = VALUE_OUTLIERS):
  """Fused key scores + online softmax + value sums over uniform 2-bit codes (see the module docstring).

  Args:
    kcodes: uint8 [BK, S, Q], planar 2-bit key codes (token-major, as the cache stores them).
    vcodes: uint8 [BK, Q, S], planar 2-bit value codes, token-contiguous (`oskvp_value_sums_mgpu.token_contiguous`),
      or block-major [BK, S/128, Q, 128] (`oskvp_value_layout.block_major`; block_s 128 only).
    qd: int8 [BK, 8, H], one digit per query head of q·d_k (rows past the group size zero).
    qs: f32 [BK, 8], the per-head scale of the integer scores in base-2 logits (digit scale · log2(e) / √H).
    lengths: int32 [BK], tokens stored per row (any value in [0, S]; tokens past it are masked in the kernel, a row
      without tokens gives zeros); None: all S (no masking work).
    kout: float8_e4m3fn [BK, S, 8], the fp8 key outlier channels of each token (as the cache stores them); vout:
      float8_e4m3fn [BK, 8, S], the value outlier channels in vcodes' layout (or [BK, S/128, 8, 128]); qo: f16
      [BK, 8, 8], the key-outlier query per head in base-2 logits (the channel scales folded in; the caller applies
      the value channels' scales to the output). Adds Σ_o qo · kout to the scores (f16 wgmma, A built in registers)
      and returns the value-outlier sums too. All three or none (codes only).
    block_s: tokens per pipeline step: 64, 128 or 256 (two passes of 128 per step, one max reduction, fence and
      set of value wgmmas; value_outliers "fp8_stacked" only; on the H200 not faster than 128 with outliers, 9%
      faster on codes alone: benchmarks/notes_mgpu_oskvp.md §20).
    splits: programs per BK row; S must be a multiple of splits · block_s.
    max_concurrent_steps: depth of the TMA ring.
    interpret: run in Mosaic GPU's CPU interpreter.
    ablate: timing experiments only (the results are wrong): "no_max" (no block max: p scaled by the initial m),
      "no_value" (no value wgmmas), "no_compute" (the blocks stream through the TMA ring, nothing else runs: the
      memory-side ceiling), "l2_resident" (every step reloads the split's first blocks, from L2 after the first
      load: the compute side alone); "" is the kernel.
    return_lse2: also return the row's log2-sum-exp2 of the scores (for merging with other tokens' attention).
    value_outliers: how the value-outlier sums run (the same sums either way): "fp8" (p8 split into two e4m3 parts,
      `split_p8`, stored to shared memory as the A operand of two fp8 × fp8 wgmmas with the value-outlier tile as B),
      "fp8_stacked" (the default: the two parts in rows 0..7 and 8..15 of one A tile: one wgmma, half the shared
      memory; the halves summed after the kernel) or "f16" (the tile widened to an f16 A operand in registers,
      repeated to 64 rows, with p8 as f16 B).

  Returns:
    f32 [BK, 8, H]: Σ_t p[n, t] · vcode[t, ch] with the softmax over the row's tokens (`decode_core_reference`,
    to the 1/127 quantization of p); with outliers, (that, f32 [BK, 8, 8] = Σ_t p[n, t] · vout[o, t]); with
    return_lse2 also f32 [BK, 8]: log2 Σ_t 2^s (-inf without tokens) as the last element.
  """
  bk, s, q = _check_inputs(kcodes, vcodes, qd, qs, block_s, splits, max_concurrent_steps)
  outliers = check_optional_inputs(bk, s, lengths, kout, vout, qo)
  if ablate not in ABLATIONS:
    raise ValueError(f"ablate={ablate!r} must be one of {ABLATIONS}")
  qs_row = padded_scales(qs, lengths, s)
  extra = ()
  if outliers:  # the key outliers as rows of two tokens (a free reshape); qo padded to the f16 wgmma's K = 16
    extra = (kout.reshape(bk, s // 2, 2 * OUTLIERS), vout, jnp.pad(qo, ((0, 0), (0, 0), (0, OUTLIERS))))
  res = _core_call(kcodes, vcodes, qd, qs_row, *extra, block_s=block_s, splits=splits,
                   max_concurrent_steps=max_concurrent_steps, interpret=interpret, ablate=ablate,
                   ragged=lengths is not None, value_outliers=value_outliers)
  mean, mean_o, lse2 = merge_splits(res[0], res[1], res[2].sum(axis=2) if outliers else None)  # acc: ACC row order
  outs = (vs.channel_rows(mean, q, 2),)
  if outliers:
    outs += (mean_o,)
  if return_lse2:
    outs += (lse2,)
  return outs[0] if len(outs) == 1 else outs
