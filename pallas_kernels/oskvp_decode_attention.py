"""Fused decode attention over an OS-KVP compressed KV cache (Pallas, Triton lowering).

The cache (per batch row b and kv head k; O = 8 outlier channels, Q = H / 4, R residual tokens):
  U_k, U_v      f32 [H, H] orthogonal; the cache stores x' = x @ U (rotated basis).
  codes         uint8 [S, Q], 2-bit codes of ALL H rotated channels, planar: byte i holds channels
                i, i+Q, i+2Q, i+3Q at bit offsets 0, 2, 4, 6.
  cb            f32 [H, 4] per-channel codebooks (the outlier channels' rows constant: their centres).
  outl          float8_e4m3fn [S, O]; scale f32 [O].
                x'_hat[s, j] = cb[j, code[s, j]] + (j < O ? outl[s, j] * scale[j] : 0).
  res           bf16 [R, H], the most recent tokens, already rotated.
  n_comp, n_res int32 [B]: valid tokens at positions [0, n_comp) of the store and [0, n_res) of the window.

Math, for query head n = k * G + g (G = N / K):
  q' = q @ U_k;  s_t = q' . k'_hat_t / sqrt(H) over compressed and residual tokens;  p = softmax(s) in f32;
  o' = sum_t p_t v'_hat_t;  o = o' @ U_v^T.

Kernel: grid (B, K, NS + 1). Programs s < NS each take one contiguous share of the compressed tokens of row b
(the share is sized from n_comp[b], so ragged batches stay balanced) in blocks of `block_s`, dequantize codes
plane by plane and feed the tensor cores with the G query heads padded to `GP = max(G, 16)` rows
("mma" form); program NS takes the residual window. Each writes an unnormalised partial (acc, m, l); a small
jnp step merges them with a log-sum-exp and rotates back by U_v^T. The query rotation (and the 1/sqrt(H) and
outlier scales, folded into the query) is done in jnp just before the call. `form="lut"` (in
`oskvp_decode_attention_lut.py`) is the CUDA-core lookup-table variant of the same kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masked_softmax
from pallas_kernels.decode_checks import check_integer_lengths, check_triton_offsets

NEG_INF = -1e30  # finite "minus infinity": exp(NEG_INF - m) is 0 and never NaN.
MMA_ROWS = 16  # smallest M of a Triton dot.


@dataclasses.dataclass(frozen=True)
class DecodeBlockConfig:
  """Tiling of the Pallas kernel.

  Attributes:
    block_s: tokens per inner step (power of two, >= 16).
    num_splits: programs per (batch row, kv head) over the compressed store; None picks one from the shapes.
    num_warps, num_stages: Triton launch parameters.
    form: "mma" (dequantize to bf16, dot on tensor cores), "lut" (query-folded lookup table on CUDA cores) or
      "bitplane" (no dequantization: int8 dots on the codes' 0/1 bit planes, `oskvp_decode_attention_bitplane.py`).
    prefetch: ("mma", "bitplane") load block i+1 while block i is computed (hand-written software pipelining);
      doubles the live tiles ("mma" spills heavily under Triton, see the notes).
    outlier_mma: ("mma"; ignored by "lut") the fp8 outlier channels go through the tensor cores as a 16-wide
      padded tile instead of a broadcast multiply-reduce on CUDA cores.
    decode: ("mma") "select" (two bit tests, three selects per element) or "poly" (code to float by the 2**23
      trick, then the cubic through the 4 codebook entries: FP32-pipe work instead of integer/logic-pipe work).
    extract: ("bitplane") how the 0/1 planes leave the code bytes: "asm" (inline PTX, four codes per 32-bit
      instruction; interpret mode falls back to "jnp") or "jnp" (per-element ops, whatever Triton makes of them).
    heads_per_program: ("bitplane") kv heads per program, their G query rows stacked block-diagonally in one
      16-row tile so that the per-row work is shared; None is 1. Not a win (see the notes): the block-diagonal query
      operands multiply the live registers by the head count and spill, and 8 heads took minutes to compile.
    query_digits: ("bitplane") int8 digits of the folded query: 2 (~15 bits) or 1 (~7 bits, half the registers).
    compact_rows: ("bitplane", one kv head per program) put the second int8 digit in the padding rows of the 16-row
      tensor-core tile instead of a second dot (query digits in the key dots, probability digits in the value dots:
      rows G..2G-1), fold the rows back to the G real ones once per block, and run the softmax on [G, block] tiles
      instead of [16, block]: half the value dots, two query digits for the price of one, a quarter of the softmax
      work at G = 4.
    outlier_f16: (compact rows) the fp8 outlier tiles and their query / probability operands in float16 instead of
      bfloat16: e4m3 converts to f16 pairs in one instruction, and f16 keeps 3 more mantissa bits.
    masked_value_planes: (compact rows) the value planes are masked in place, not shifted down (one instruction per
      4 codes instead of two); the power-of-two weights they carry are folded into the per-row scales.
    pallas_prologue: (compact rows) the query's rotation, codebook folding and int8 digits in one small Pallas
      kernel (`oskvp_decode_prologue.py`) instead of ~8 XLA fusions, each a launch and a gap per decode step.
    values_in_kernel: (compact rows) each program applies the value codebooks, the probability digits' weights and
      the value outliers to its own partial sums and writes its rotated output [4, G, Q] (a quarter of the partial
      bytes at T = 3), so the merge after the kernel is only the log-sum-exp weighting and U_v^T. None: on with
      general codebooks, off with symmetric ones, where the attention kernel measured 6-8% slower with it at batch 8
      (benchmarks/results/decode_attention_breakdown.md).
  """

  # Defaults: the fastest "mma" tiling on the H200 (block 64, outliers on the tensor cores, 1 stage: 0.94-1.06 ms
  # at 64k x 8, against 1.87 ms for the first session's block 128 / 2 stages, which spilled). The GPU default for
  # head dims >= 128 is `BITPLANE` (`default_config`).
  block_s: int = 64
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 1
  form: str = "mma"
  prefetch: bool = False
  outlier_mma: bool = True
  decode: str = "select"
  extract: str = "asm"
  heads_per_program: int | None = None
  query_digits: int = 2
  compact_rows: bool = False
  outlier_f16: bool = False
  masked_value_planes: bool = False
  pallas_prologue: bool = False
  values_in_kernel: bool | None = False

  def __post_init__(self):
    if self.block_s < 16 or self.block_s & (self.block_s - 1):
      raise ValueError(f"{self.block_s=} must be a power of two >= 16")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"{self.num_splits=} must be >= 1")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.num_warps=} must be a power of two <= 16")
    if self.num_stages < 1:
      raise ValueError(f"{self.num_stages=} must be >= 1")
    if self.form not in ("mma", "lut", "bitplane"):
      raise ValueError(f"{self.form=} must be 'mma', 'lut' or 'bitplane'")
    if self.decode not in ("select", "poly"):
      raise ValueError(f"{self.decode=} must be 'select' or 'poly'")
    if self.query_digits not in (1, 2):
      raise ValueError(f"{self.query_digits=} must be 1 or 2")
    if self.extract not in ("asm", "jnp"):
      raise ValueError(f"{self.extract=} must be 'asm' or 'jnp'")
    compact_only = dict(outlier_f16=self.outlier_f16, masked_value_planes=self.masked_value_planes,
                        pallas_prologue=self.pallas_prologue, values_in_kernel=self.values_in_kernel is not False)
    if any(compact_only.values()) and not self.compact_rows:
      raise ValueError(f"{compact_only} apply with compact_rows=True only")
    if self.compact_rows and (self.form != "bitplane" or (self.heads_per_program or 1) > 1):
      raise ValueError(f"{self.compact_rows=} needs form='bitplane' and one kv head per program")
    if self.form == "lut" and self.prefetch:
      raise ValueError(f"{self.prefetch=} applies to forms 'mma' and 'bitplane' only")


# The fastest bit-plane tiling on the H200 at 64k x 8: block 256, 1 stage, compact rows (so two query digits cost
# nothing), f16 outliers and masked value planes: 0.461 ms (0.430 with symmetric codebooks) against cuDNN's 0.538 ms
# on a bf16 cache in the same run (decode_attention_run8.log); compact rows alone 0.514 there (0.477 in run 7's
# grid, where the previous one-digit default took 0.640). Block 128, 8 warps, 16 splits (except symmetric: 0.422),
# 2 stages and prefetching slower (decode_attention_run7.log, decode_attention_sweep{5,6}.log).
# Around the kernel, the Pallas query prologue and (general codebooks) the values applied in-kernel: 5-6 kernels per
# call instead of 12-15, 383 us of kernel time instead of 400 at 64k x 8 (346 instead of 350 with symmetric
# codebooks), 25 instead of 31 at 4k x 1 (results/decode_attention_breakdown.md).
BITPLANE = DecodeBlockConfig(form="bitplane", block_s=256, num_stages=1, query_digits=2, compact_rows=True,
                             outlier_f16=True, masked_value_planes=True, pallas_prologue=True, values_in_kernel=None)
# The bit-plane default before compact rows (one dot per operand digit, one query digit): kept for comparisons.
PLAIN_ROWS = DecodeBlockConfig(form="bitplane", block_s=256, num_stages=1, query_digits=1)


# Compact rows hold both query digits of G heads in one 16-row tile: G <= 8. Past that (e.g. qwen3_235b_a22b's
# G = 16) the bit-plane form runs its two digits as two dots. At G = 16, head dim 128, batch 8 on the H100
# (benchmarks/results/oskvp_g16_decode_h100_s33.md) blocks of 128 tokens beat 256 (0.172 against 0.185 ms at 16k,
# 0.403 against 0.415 at 64k) and every other form; none beats cuDNN on a bf16 cache there (0.134 / 0.398 ms).
TWO_DOT_BITPLANE = DecodeBlockConfig(form="bitplane", block_s=128, num_stages=1, query_digits=2)


def default_config(head_dim: int, g: int = 4) -> DecodeBlockConfig:
  """The measured-fastest form for the head dim and G query heads per kv head: bit planes where each plane spans
  >= 32 channels (compact rows while 2 G fits a 16-row tile), else "mma"."""
  if head_dim // 4 < 32:
    return DecodeBlockConfig()
  return BITPLANE if 2 * g <= 16 else TWO_DOT_BITPLANE


def supports_key_high_bits(head_dim: int, g: int) -> bool:
  """Whether the kernel at `default_config(head_dim, g)` takes 3-bit keys (`hi_k`): only the compact bit-plane form
  reads them, at shapes `check_kernel_shapes` accepts with power-of-two tiles (head dim 128 or 256, G a power of two
  <= 8)."""
  config = default_config(head_dim, g)
  pow2 = lambda x: x > 0 and not x & (x - 1)  # noqa: E731
  return config.form == "bitplane" and config.compact_rows and pow2(head_dim // 4) and pow2(g)


def default_num_splits(batch: int, kv_heads: int, capacity: int, block_s: int, target_programs: int = 512) -> int:
  """Enough programs to fill a large GPU (~4 per SM on 132 SMs), without splits shorter than 2 blocks."""
  return max(1, min(pl.cdiv(target_programs, batch * kv_heads), pl.cdiv(capacity, 2 * block_s)))


# ----------------------------------------------------------------------------------------------------------------
# Reference (plain jnp).


def unpack_codes(codes: jax.Array) -> jax.Array:
  """uint8 [..., Q] planar-packed -> int32 [..., 4Q] codes in channel order (channel p*Q + i = byte i, bits 2p)."""
  planes = (codes[..., None, :].astype(jnp.int32) >> (2 * jnp.arange(4)[:, None])) & 3  # [..., 4, Q]
  return planes.reshape(*codes.shape[:-1], 4 * codes.shape[-1])


def unpack_high_bits(hi: jax.Array) -> jax.Array:
  """uint8 [..., H/8] -> int32 [..., H] third code bits in channel order (channel m*H/8 + i = byte i, bit m)."""
  bits = (hi[..., None, :].astype(jnp.int32) >> jnp.arange(8)[:, None]) & 1  # [..., 8, H/8]
  return bits.reshape(*hi.shape[:-1], 8 * hi.shape[-1])


def dequantize_rotated(codes: jax.Array, outl: jax.Array, scale: jax.Array, cb: jax.Array,
                       hi: jax.Array | None = None) -> jax.Array:
  """Rotated keys/values of the compressed store.

  Args:
    codes: uint8 [B, K, S, H/4]; outl: float8 [B, K, S, O]; scale: f32 [B, K, O]; cb: f32 [B, K, H, L] (L = 4, or 8
      with `hi`); hi: uint8 [B, K, S, H/8] the third code bit of 3-bit codes, or None.

  Returns:
    f32 [B, K, S, H] = cb[j, code_j] + (j < O ? outl_j * scale_j : 0).
  """
  c = unpack_codes(codes)  # [B, K, S, H]
  if hi is not None:
    c = c | (unpack_high_bits(hi) << 2)
  x = jnp.take_along_axis(cb[:, :, None].astype(jnp.float32), c[..., None], axis=-1)[..., 0]  # [B, K, S, H]
  o = outl.shape[-1]
  return x.at[..., :o].add(outl.astype(jnp.float32) * scale[:, :, None, :].astype(jnp.float32))


def oskvp_decode_attention_reference(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v,
                                     res_k, res_v, n_comp, n_res, *, hi_k=None, **unused) -> jax.Array:
  """Plain-jnp decode attention over the OS-KVP cache (same arguments as `oskvp_decode_attention`, `hi_k` included).

  Jitted (one program per shape); the other keyword arguments of `oskvp_decode_attention` in `unused` are ignored.

  Returns:
    [B, N, H] in q's dtype. Needs n_comp + n_res >= 1 for every row.
  """
  del unused
  return _reference_jit(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v,
                        n_comp, n_res, hi_k)


@jax.jit
def _reference_jit(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v, n_comp,
                   n_res, hi_k=None) -> jax.Array:
  """`oskvp_decode_attention_reference` without its ignored keyword arguments (jitted)."""
  b, n, h = q.shape
  kh, s, r = codes_k.shape[1], codes_k.shape[2], res_k.shape[2]
  hi = lax.Precision.HIGHEST
  qr = jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32).reshape(b, kh, n // kh, h), u_k, precision=hi)
  k_hat = dequantize_rotated(codes_k, outl_k, scale_k, cb_k, hi_k)  # [B, K, S, H]
  v_hat = dequantize_rotated(codes_v, outl_v, scale_v, cb_v)
  keys = jnp.concatenate([k_hat, res_k.astype(jnp.float32)], axis=2)  # [B, K, S + R, H]
  vals = jnp.concatenate([v_hat, res_v.astype(jnp.float32)], axis=2)
  pos = jnp.arange(s + r)
  visible = jnp.where(pos[None] < s, pos[None] < n_comp[:, None], pos[None] - s < n_res[:, None])  # [B, S + R]
  scores = jnp.einsum("BKGJ,BKSJ->BKGS", qr, keys, precision=hi) * h**-0.5
  vals = jnp.where(visible[:, None, :, None], vals, 0.0)  # an invisible slot's value never reaches the output
  probs = masked_softmax.masked_probs(scores, visible[:, None, None])
  o_rot = jnp.einsum("BKGS,BKSJ->BKGJ", probs, vals, precision=hi)
  o = jnp.einsum("BKGJ,BKHJ->BKGH", o_rot, u_v, precision=hi)
  return o.reshape(b, n, h).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Kernel ("mma" form).


def split_range(n_ref, split, num_splits: int, block_s: int):
  """Split `split`'s token range [start, end) of the compressed store and its number of blocks."""
  n = n_ref[()]
  chunk = pl.cdiv(pl.cdiv(n, num_splits), block_s) * block_s
  start = split * chunk
  end = jnp.minimum(n, start + chunk)
  return start, end, pl.cdiv(jnp.maximum(end - start, 0), block_s)


def dequant_plane(x: jax.Array, plane: int, cb: list[jax.Array], dtype=jnp.float32) -> jax.Array:
  """x: int32 [bs, Q] packed code bytes; cb: 4 f32 rows [1, Q] (one per code) -> [bs, Q] cb[code of `plane`].

  Two bit tests and three selects per element, on int32 codes and f32 codebook rows, cast at the end: in the
  compiled loop this is ~20% fewer instructions than the same on uint8 codes and bf16 rows (one byte unpack per
  tile instead of per plane; the bit tests become predicate-producing LOP3s; F2FP packs the bf16 pairs).
  """
  b0 = (x & (1 << 2 * plane)) != 0
  b1 = (x & (2 << 2 * plane)) != 0
  return jnp.where(b1, jnp.where(b0, cb[3], cb[2]), jnp.where(b0, cb[1], cb[0])).astype(dtype)


def fp8_rows(ref, rows, valid, cols: int, width: int, head=None, dtype=jnp.float32):
  """Masked load of fp8 outlier rows -> [bs, width] in dtype, zero on invalid rows and on columns >= cols.

  Triton cannot splat an `other` to fp8, and an unloaded fp8 lane may hold a NaN encoding (0 * NaN would spread
  into the accumulator), so masked lanes are zeroed after the conversion. width > cols (a power of two, as Triton
  tiles must be) reads a padded tile whose extra columns are masked off (no memory traffic). `head`: a leading index
  into a [heads, S, O] ref (one indexer: Triton lowers no chained `.at`). dtype float16 converts e4m3 pairs directly
  (one instruction per two values on Hopper) where f32 and bf16 go through wider conversions.
  """
  lead = () if head is None else (jnp.int32(head),)
  if width == cols:
    x = plgpu.load(ref.at[(*lead, rows, slice(None))], mask=valid[:, None]).astype(dtype)
    return jnp.where(valid[:, None], x, jnp.zeros((), dtype))
  mask = valid[:, None] & (jnp.arange(width) < cols)[None, :]
  x = plgpu.load(ref.at[(*lead, rows, pl.ds(0, width))], mask=mask).astype(dtype)
  return jnp.where(mask, x, jnp.zeros((), dtype))


# Monomial coefficients of the cubic through (c, cb[c]), c = 0..3: poly[d] = sum_c POLY[d, c] * cb[c].
POLY = ((1.0, 0.0, 0.0, 0.0), (-11 / 6, 3.0, -1.5, 1 / 3), (1.0, -2.5, 2.0, -0.5), (-1 / 6, 0.5, -0.5, 1 / 6))
MAGIC = 0x4B000000  # float bits of 2**23: (MAGIC | c) as f32 is 2**23 + c exactly for 0 <= c < 2**23


def dequant_plane_poly(x: jax.Array, plane: int, poly: list[jax.Array], dtype=jnp.float32) -> jax.Array:
  """x: int32 [bs, Q] code bytes; poly: 4 f32 rows [1, Q] (cubic coefficients) -> [bs, Q] cb[code of `plane`].

  The code becomes a float with one shift, one LOP3 and one FADD (no conversion instruction), then three FMAs:
  the work moves from the integer/logic pipe (64 lanes/clk/SM) to the FP32 pipe (128).
  """
  c = lax.bitcast_convert_type(((x >> 2 * plane) & 3) | MAGIC, jnp.float32) - float(2**23)
  return (((poly[3] * c + poly[2]) * c + poly[1]) * c + poly[0]).astype(dtype)


def online_softmax_update(scores, valid, m, l):
  """scores f32 [GP, bs], valid bool [bs] -> (p [GP, bs], alpha [GP], m_new, l_new)."""
  scores = jnp.where(valid[None, :], scores, NEG_INF)
  m_new = jnp.maximum(m, scores.max(axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(scores - m_new[:, None])
  return p, alpha, m_new, alpha * l + p.sum(axis=1)


def nonzero_denominator(denom: jax.Array) -> jax.Array:
  """A softmax denominator safe to divide by: 1 where it is 0 (a row with no visible token, whose sums are 0 too),
  so that the row comes out zero as in the references, not 0 / 0."""
  return jnp.where(denom > 0, denom, 1.0)


def merge_split_partials(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """acc [..., NS, G, H], m, l [..., NS, G] (f32 partials of NS splits) -> [..., G, H] by log-sum-exp; zeros where
  no split saw a token."""
  w = jnp.exp(m - m.max(axis=-2, keepdims=True))  # [..., NS, G]; empty splits (m = NEG_INF, l = 0) weigh 0
  denom = (w * l).sum(axis=-2)[..., None]
  return (w[..., None] * acc).sum(axis=-3) / nonzero_denominator(denom)


def run_blocks(nblocks, load_block, compute, state0, prefetch: bool):
  """fori_loop over a split's blocks: compute(i, load_block(i), *state) -> state. With `prefetch`, block i+1's loads
  are issued before block i is computed (hand-written software pipelining; masked off past the end)."""
  if not prefetch:
    return lax.fori_loop(0, nblocks, lambda i, c: compute(i, load_block(i), *c), state0)

  def body(i, carry):
    tiles, state = carry
    return load_block(i + 1), compute(i, tiles, *state)

  return lax.fori_loop(0, nblocks, body, (load_block(0), state0))[1]


def window_attention(n, block_r: int, qp, rk_ref, rv_ref, acc0, m0, l0, head_rows=None):
  """Online softmax over the bf16 residual window on the tensor cores (the window program of "mma" and "bitplane").

  Args:
    n: [] int32 valid window tokens. qp: qp[h][p] bf16 [GP, Q], the query planes of each of the HP kv heads.
    rk_ref, rv_ref: [R, H] (one head) or [HP, R, H] bf16. acc0: 4 f32 [GP, Q]; m0, l0 f32 [GP].
    head_rows: (x [GP, n], h) -> x on head h's rows, zero elsewhere; None with one head.

  Returns:
    (acc: 4 f32 [GP, Q] planes of sum_t p_t v'_t, m, l).
  """
  gp, q_dim = qp[0][0].shape

  def load(ref, h, rows, p, valid):  # [br, Q]
    lead = (jnp.int32(h),) if len(ref.shape) == 3 else ()
    return plgpu.load(ref.at[(*lead, rows, pl.ds(p * q_dim, q_dim))], mask=valid[:, None], other=0)

  def body(i, carry):
    acc, m, l = carry
    r0 = i * block_r
    valid = r0 + jnp.arange(block_r) < n
    rows = pl.ds(r0, block_r)
    scores = jnp.zeros((gp, block_r), jnp.float32)
    for h, qh in enumerate(qp):
      for p in range(4):
        scores += plgpu.dot(qh[p], load(rk_ref, h, rows, p, valid), trans_b=True)
    pexp, alpha, m, l = online_softmax_update(scores, valid, m, l)
    pb = pexp.astype(jnp.bfloat16)
    acc = [a * alpha[:, None] for a in acc]
    for h in range(len(qp)):
      pbh = pb if head_rows is None else head_rows(pb, h)
      for p in range(4):
        acc[p] += plgpu.dot(pbh, load(rv_ref, h, rows, p, valid))
    return acc, m, l

  return lax.fori_loop(0, pl.cdiv(n, block_r), body, (acc0, m0, l0))


def _mma_kernel(qp_ref, qo_ref, cbk_ref, ck_ref, ok_ref, cbv_ref, cv_ref, ov_ref, rk_ref, rv_ref, nc_ref, nr_ref,
                acc_ref, acco_ref, m_ref, l_ref, *, num_splits: int, block_s: int, block_r: int, prefetch: bool,
                outlier_mma: bool, o_dim: int, poly: bool):
  # qp_ref [4, GP, Q] bf16 (rotated, scaled query, by plane); qo_ref [GP, OP] (outlier query x scale_k, zero
  # padded to OP = a power of two >= O; f32, or bf16 and OP >= 16 with outlier_mma);
  # cbk_ref, cbv_ref [4 planes, 4 codes, Q] f32; ck_ref, cv_ref [S, Q] uint8; ok_ref, ov_ref [S, O] fp8;
  # rk_ref, rv_ref [R, H] bf16; nc_ref, nr_ref [] int32.
  # acc_ref [4, GP, Q] f32; acco_ref [GP, OP] f32; m_ref, l_ref [GP] f32.
  gp, q_dim = qp_ref.shape[1], qp_ref.shape[2]
  split = pl.program_id(2)  # read here: interpret mode cannot see program_id inside `pl.when`.
  qp = [qp_ref[p] for p in range(4)]  # [GP, Q] bf16 each
  m0 = jnp.full((gp,), NEG_INF, jnp.float32)
  l0 = jnp.zeros((gp,), jnp.float32)
  acc0 = [jnp.zeros((gp, q_dim), jnp.float32) for _ in range(4)]

  def write(acc, acco, m, l):
    for p in range(4):
      acc_ref[p] = acc[p]
    acco_ref[...] = acco
    m_ref[...] = m
    l_ref[...] = l

  @pl.when(split < num_splits)
  def _compressed():
    start, end, nblocks = split_range(nc_ref, split, num_splits, block_s)
    qo = qo_ref[...]  # [GP, OP]: f32 (broadcast path) or bf16 padded to 16 columns (outlier_mma)
    decode = dequant_plane_poly if poly else dequant_plane
    cbk = [[cbk_ref[p, c][None, :] for c in range(4)] for p in range(4)]  # [1, Q] f32 (codebook or cubic rows)
    cbv = [[cbv_ref[p, c][None, :] for c in range(4)] for p in range(4)]

    def load_block(i):
      """Raw tiles of block i: codes [bs, Q] uint8 (K, V) and outliers [bs, OP] f32 (K, V), zero where invalid."""
      s0 = start + i * block_s
      valid = s0 + jnp.arange(block_s) < end
      rows = pl.ds(s0, block_s)
      ck = plgpu.load(ck_ref.at[rows, :], mask=valid[:, None], other=0)
      cv = plgpu.load(cv_ref.at[rows, :], mask=valid[:, None], other=0)
      op = acco_ref.shape[1]  # O padded to a power of two (>= 16 with outlier_mma, for the tensor cores)
      return ck, fp8_rows(ok_ref, rows, valid, o_dim, op), cv, fp8_rows(ov_ref, rows, valid, o_dim, op)

    def compute(i, tiles, acc, acco, m, l):
      ck, ok, cv, ov = tiles
      ck, cv = ck.astype(jnp.int32), cv.astype(jnp.int32)  # widened once per tile, see dequant_plane
      valid = start + i * block_s + jnp.arange(block_s) < end  # [bs]
      if outlier_mma:
        scores = plgpu.dot(qo, ok.astype(jnp.bfloat16), trans_b=True)  # [GP, bs]
      else:
        scores = (qo[:, None, :] * ok[None, :, :]).sum(axis=2)  # [GP, bs]
      for p in range(4):
        scores += plgpu.dot(qp[p], decode(ck, p, cbk[p], jnp.bfloat16), trans_b=True)
      pexp, alpha, m, l = online_softmax_update(scores, valid, m, l)
      pb = pexp.astype(jnp.bfloat16)
      if outlier_mma:
        acco = acco * alpha[:, None] + plgpu.dot(pb, ov.astype(jnp.bfloat16))  # [GP, OP]
      else:
        acco = acco * alpha[:, None] + (pexp[:, :, None] * ov[None, :, :]).sum(axis=1)  # [GP, O]
      acc = [acc[p] * alpha[:, None] + plgpu.dot(pb, decode(cv, p, cbv[p], jnp.bfloat16)) for p in range(4)]
      return acc, acco, m, l

    acco0 = jnp.zeros(acco_ref.shape, jnp.float32)
    write(*run_blocks(nblocks, load_block, compute, (acc0, acco0, m0, l0), prefetch))

  @pl.when(split == num_splits)
  def _residual():
    acc, m, l = window_attention(nr_ref[()], block_r, [qp], rk_ref, rv_ref, acc0, m0, l0)
    write(acc, jnp.zeros(acco_ref.shape, jnp.float32), m, l)


# ----------------------------------------------------------------------------------------------------------------
# Wrapper: query rotation before, log-sum-exp merge and back-rotation after.


def prepare_query(q, u_k, scale_k, kv_heads: int, rows: int):
  """q [B, N, H] -> (q_planes f32 [B, K, 4, rows, Q], q_outl f32 [B, K, rows, O]); rows >= G are zero."""
  b, n, h = q.shape
  g = n // kv_heads
  qr = jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32).reshape(b, kv_heads, g, h), u_k,
                  precision=lax.Precision.HIGHEST) * h**-0.5  # [B, K, G, H]
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  q_planes = qr.reshape(b, kv_heads, rows, 4, h // 4).transpose(0, 1, 3, 2, 4)
  q_outl = qr[..., :scale_k.shape[-1]] * scale_k[:, :, None, :]
  return q_planes, q_outl


def plane_codebooks(cb, poly: bool = False):
  """cb [B, K, H, 4] -> [B, K, 4 planes, 4 codes (or 4 cubic coefficients with poly), Q] f32."""
  b, k, h, _ = cb.shape
  cb = cb.astype(jnp.float32)
  if poly:
    cb = jnp.einsum("BKHC,DC->BKHD", cb, jnp.asarray(POLY, jnp.float32), precision=lax.Precision.HIGHEST)
  return cb.reshape(b, k, 4, h // 4, 4).transpose(0, 1, 2, 4, 3)


def merge_partials(acc, acco, m, l, scale_v, u_v, groups: int, dtype):
  """Log-sum-exp merge over splits and rotation back (zeros for a row with no visible token, as the reference).

  Args:
    acc [B, K, NS+1, 4, GP, Q], acco [B, K, NS+1, GP, >= O], m, l [B, K, NS+1, GP] (f32); scale_v [B, K, O];
    u_v [B, K, H, H].

  Returns:
    [B, N, H] in dtype.
  """
  b, kh, _, _, _, qd = acc.shape
  o_dim = scale_v.shape[-1]
  acc, acco, m, l = acc[..., :groups, :], acco[..., :groups, :o_dim], m[..., :groups], l[..., :groups]
  w = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, K, NS+1, G]
  denom = (w * l).sum(axis=2)  # [B, K, G]
  o_rot = jnp.einsum("BKSG,BKSPGQ->BKGPQ", w, acc, precision=lax.Precision.HIGHEST).reshape(b, kh, groups, 4 * qd)
  o_out = jnp.einsum("BKSG,BKSGO->BKGO", w, acco, precision=lax.Precision.HIGHEST) * scale_v[:, :, None, :]
  o_rot = o_rot.at[..., :o_out.shape[-1]].add(o_out) / nonzero_denominator(denom)[..., None]
  o = jnp.einsum("BKGJ,BKHJ->BKGH", o_rot, u_v, precision=lax.Precision.HIGHEST)
  return o.reshape(b, kh * groups, 4 * qd).astype(dtype)


def drop_aliased_inputs(kernel, n_inputs, n_aliased, *refs):
  """Calls `kernel` without the `n_aliased` refs that follow its `n_inputs` inputs (the poisoned aliased outputs)."""
  return kernel(*refs[:n_inputs], *refs[n_inputs + n_aliased:])


def poison_outputs(kernel, inputs, in_specs, out_specs, out_shape):
  """Partials that start as NaN: every output is an aliased input filled with NaN, so any element the kernel skips
  poisons the result. Returns (kernel, inputs, in_specs, input_output_aliases) for `pallas_call`."""
  n_in = len(inputs)
  aliases = {n_in + i: i for i in range(len(out_shape))}
  inputs = inputs + [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
  kernel = functools.partial(drop_aliased_inputs, kernel, n_in, len(aliases))
  return kernel, inputs, in_specs + out_specs, aliases


_ARGS = ("q", "codes_k", "outl_k", "scale_k", "cb_k", "codes_v", "outl_v", "scale_v", "cb_v", "u_k", "u_v", "res_k",
         "res_v", "n_comp", "n_res")


def check_layout(*args, hi_k=None) -> None:
  """Raises ValueError naming the argument (in `oskvp_decode_attention`'s order) whose shape or dtype does not fit
  q [B, N, H] and codes_k [B, K, S, H/4], the layout of its docstring (checked at trace time, free at run time)."""
  a = dict(zip(_ARGS, args))
  for name, rank in (("q", 3), ("codes_k", 4), ("outl_k", 4), ("res_k", 4)):  # the shapes the others are read from
    if a[name].ndim != rank:
      raise ValueError(f"{name} must have rank {rank} (see oskvp_decode_attention), got shape {a[name].shape}")
  b, n, h = a["q"].shape
  _, kh, s, _ = a["codes_k"].shape
  if n % kh:
    raise ValueError(f"{kh=} kv heads must divide {n=} query heads")
  o_k, o_v, r = a["outl_k"].shape[-1], a["outl_v"].shape[-1], a["res_k"].shape[2]
  want = dict(codes_k=(b, kh, s, h // 4), codes_v=(b, kh, s, h // 4), outl_k=(b, kh, s, o_k), outl_v=(b, kh, s, o_v),
              scale_k=(b, kh, o_k), scale_v=(b, kh, o_v), cb_k=(b, kh, h, 4 if hi_k is None else 8),
              cb_v=(b, kh, h, 4), u_k=(b, kh, h, h), u_v=(b, kh, h, h), res_k=(b, kh, r, h), res_v=(b, kh, r, h),
              n_comp=(b,), n_res=(b,))
  if hi_k is not None:
    a["hi_k"] = hi_k
    want["hi_k"] = (b, kh, s, h // 8)
    if hi_k.dtype != jnp.uint8:
      raise ValueError(f"hi_k must be uint8 (the keys' third code bits, 8 channels a byte), got dtype {hi_k.dtype}")
  for name, shape in want.items():
    if tuple(a[name].shape) != shape:
      raise ValueError(f"{name} must have shape {shape} for q {tuple(a['q'].shape)} and codes_k "
                       f"{tuple(a['codes_k'].shape)}, got {tuple(a[name].shape)}")
  check_integer_lengths(n_comp=a["n_comp"], n_res=a["n_res"])


def kernel_shape_problem(q, codes_k, outl_k, outl_v, res_k) -> str | None:
  """Why the Pallas kernel cannot take these shapes (beyond `check_layout`), or None: H a power of two >= 64 (each
  code plane is a Triton dot of >= 16 columns, and Triton's tiles are powers of two), G = N / K a power of two,
  1..H outlier channels, as many for the values as for the keys (one count sizes both tiles), and a store and a
  window of at least one slot each."""
  _, n, h = q.shape
  kh, s, r = codes_k.shape[1], codes_k.shape[2], res_k.shape[2]
  if h < 64 or h & (h - 1):
    return f"head dim {h=} must be a power of two >= 64 (Triton tiles; each code plane a dot of >= 16)"
  g = n // kh
  if g & (g - 1):
    return f"G = N / K = {g} must be a power of two"
  o, o_v = outl_k.shape[-1], outl_v.shape[-1]
  if not 1 <= o <= h:
    return f"outlier channels {o=} must be in [1, H]"
  if o_v != o:
    return f"outl_v has {o_v} outlier channels and outl_k {o}: the kernel reads both with one count"
  if s < 1 or r < 1:
    return f"the store (S={s}) and the window (R={r}) must hold at least one slot each"
  return None


def check_kernel_shapes(q, codes_k, outl_k, outl_v, res_k) -> None:
  """Raises ValueError with `kernel_shape_problem`'s reason, if any."""
  problem = kernel_shape_problem(q, codes_k, outl_k, outl_v, res_k)
  if problem is not None:
    raise ValueError(problem)


@functools.partial(jax.jit, static_argnames=["interpret", "config", "poison", "symmetric_codebooks"])
def _oskvp_pallas(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v,
                  n_comp, n_res, hi_k=None, *, interpret: bool, config: DecodeBlockConfig, poison: bool = False,
                  symmetric_codebooks: bool = False):
  # Lengths past the store / window read as all of it (as the reference does); unclipped they index other rows.
  n_comp, n_res = jnp.clip(n_comp, 0, codes_k.shape[2]), jnp.clip(n_res, 0, res_k.shape[2])
  if config.form == "bitplane":
    from pallas_kernels.oskvp_decode_attention_bitplane import oskvp_bitplane_pallas  # pylint: disable=g-import-not-at-top
    return oskvp_bitplane_pallas(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k,
                                 res_v, n_comp, n_res, hi_k, interpret=interpret, config=config, poison=poison,
                                 symmetric_codebooks=symmetric_codebooks)
  if hi_k is not None:
    raise ValueError(f"hi_k (3-bit keys) needs the compact bit-plane form, not form={config.form!r} "
                     "(`supports_key_high_bits`)")
  b, n, h = q.shape
  _, kh, s, qd = codes_k.shape
  g, o_dim, r = n // kh, outl_k.shape[-1], res_k.shape[2]
  ns = config.num_splits or default_num_splits(b, kh, s, config.block_s)
  block_r = min(config.block_s, max(16, pl.next_power_of_2(r)))
  rows = max(g, MMA_ROWS) if config.form == "mma" else g
  q_planes, q_outl = prepare_query(q, u_k, scale_k, kh, rows)
  # Columns of the outlier query / accumulator tiles: a power of two (Triton), >= 16 on the tensor cores.
  outlier_mma = config.outlier_mma and config.form == "mma"  # the lut form keeps its outliers on CUDA cores
  o_cols = max(pl.next_power_of_2(o_dim), MMA_ROWS if outlier_mma else 1)
  q_outl = jnp.pad(q_outl, ((0, 0), (0, 0), (0, 0), (0, o_cols - o_dim)))
  if config.form == "mma":
    q_planes = q_planes.astype(jnp.bfloat16)
    if outlier_mma:
      q_outl = q_outl.astype(jnp.bfloat16)
    kernel = functools.partial(_mma_kernel, prefetch=config.prefetch, outlier_mma=config.outlier_mma, o_dim=o_dim,
                               poly=config.decode == "poly")
  else:
    from pallas_kernels.oskvp_decode_attention_lut import lut_kernel  # pylint: disable=g-import-not-at-top
    kernel = functools.partial(lut_kernel, o_dim=o_dim)
  kernel = functools.partial(kernel, num_splits=ns, block_s=config.block_s, block_r=block_r)

  def per_head(*tail):
    return pl.BlockSpec((None, None, *tail), lambda i, j, t: (i, j) + (0,) * len(tail))

  def per_row():
    return pl.BlockSpec((None,), lambda i, j, t: (i,))

  def per_prog(*tail):
    return pl.BlockSpec((None, None, None, *tail), lambda i, j, t: (i, j, t) + (0,) * len(tail))

  out_shape = [jax.ShapeDtypeStruct((b, kh, ns + 1, 4, rows, qd), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, ns + 1, rows, o_cols), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, ns + 1, rows), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, ns + 1, rows), jnp.float32)]
  out_specs = [per_prog(4, rows, qd), per_prog(rows, o_cols), per_prog(rows), per_prog(rows)]
  in_specs = [per_head(4, rows, qd), per_head(rows, o_cols), per_head(4, 4, qd), per_head(s, qd), per_head(s, o_dim),
              per_head(4, 4, qd), per_head(s, qd), per_head(s, o_dim), per_head(r, h), per_head(r, h), per_row(),
              per_row()]
  poly = config.form == "mma" and config.decode == "poly"
  inputs = [q_planes, q_outl, plane_codebooks(cb_k, poly), codes_k, outl_k, plane_codebooks(cb_v, poly), codes_v,
            outl_v, res_k, res_v, n_comp.astype(jnp.int32), n_res.astype(jnp.int32)]
  aliases = {}
  if poison:
    kernel, inputs, in_specs, aliases = poison_outputs(kernel, inputs, in_specs, out_specs, out_shape)
  acc, acco, m, l = pl.pallas_call(
      kernel,
      grid=(b, kh, ns + 1),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=f"oskvp_decode_{config.form}",
  )(*inputs)
  return merge_partials(acc, acco, m, l, scale_v, u_v, g, q.dtype)


def oskvp_decode_attention(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v,
                           n_comp, n_res, *, hi_k=None, implementation: str = "pallas", interpret: bool = False,
                           config: DecodeBlockConfig | None = None, symmetric_codebooks: bool = False) -> jax.Array:
  """Decode attention (one query token per sequence) over the OS-KVP cache.

  Args:
    q: [B, N, H] queries, unrotated (N = K * G, query head n reads kv head n // G).
    codes_k, codes_v: uint8 [B, K, S, H/4] planar-packed 2-bit codes.
    outl_k, outl_v: float8_e4m3fn [B, K, S, O]; scale_k, scale_v: f32 [B, K, O].
    cb_k, cb_v: f32 [B, K, H, 4] per-channel codebooks (cb_k [B, K, H, 8] with `hi_k`).
    u_k, u_v: f32 [B, K, H, H] orthogonal rotations.
    res_k, res_v: bf16 [B, K, R, H] residual window, rotated.
    n_comp, n_res: int32 [B] valid tokens in the store and in the window (n_comp + n_res >= 1).
    hi_k: uint8 [B, K, S, H/8] the keys' third code bits (3-bit keys, `OSKVPMode(key_bits=3)`; code = 2-bit code +
      4 * bit, `pack1`'s layout: channel m * H/8 + i in byte i, bit m), or None. Only the compact bit-plane form
      reads them (`supports_key_high_bits`): seven key plane types instead of three (four with symmetric
      codebooks).
    implementation: "pallas" (the fused kernel; on CPU pass interpret=True) or "xla" (the jnp reference).
    interpret: run the Pallas kernel in interpret mode (CPU).
    config: form and tiling; None uses `default_config(H, G)` (the bit-plane form for H >= 128).
    symmetric_codebooks: every codebook row is symmetric about a centre, cb[c] + cb[L-1-c] the same for every c
      (cb0 + cb3 = cb1 + cb2 at 4 levels; `OSKVPMode(symmetric=True)`); the bit-plane form then skips the b0 & b1
      plane (a third less work), and with `hi_k` reads four key plane types instead of seven. Results are wrong if
      the rows are not.

  Returns:
    [B, N, H] in q's dtype.
  """
  args = (q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v, n_comp, n_res)
  check_layout(*args, hi_k=hi_k)
  if implementation == "xla":
    return oskvp_decode_attention_reference(*args, hi_k=hi_k)
  if implementation != "pallas":
    raise ValueError(f"{implementation=} must be 'pallas' or 'xla'")
  check_kernel_shapes(q, codes_k, outl_k, outl_v, res_k)
  check_triton_offsets(codes_k=codes_k, codes_v=codes_v, outl_k=outl_k, outl_v=outl_v)
  g = q.shape[1] // codes_k.shape[1]
  return _oskvp_pallas(*args, hi_k, interpret=interpret, config=config or default_config(q.shape[-1], g),
                       symmetric_codebooks=symmetric_codebooks)


def attention_bytes(batch: int, kv_heads: int, context: int, head_dim: int, outliers: int = 8,
                    residual: int = 0) -> int:
  """Bytes the kernel must read for `context` compressed tokens (+ `residual` bf16 ones), K and V."""
  per_token = head_dim // 4 + outliers  # codes + fp8 outliers
  return 2 * batch * kv_heads * (context * per_token + residual * head_dim * 2)
