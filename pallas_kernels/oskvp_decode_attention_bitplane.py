"""Bit-plane form of the OS-KVP decode-attention kernel: int8 tensor-core dots on 0/1 planes, no dequantization.

Same cache, grid and split-K scheme as `oskvp_decode_attention.py` (form="mma"), selected with
`DecodeBlockConfig(form="bitplane")`; the jnp reference there is this kernel's reference too.

Why: the "mma" form decodes every 2-bit code to a bf16 codebook value (~10 instructions per code in the compiled
loop), which bounds it far above the byte floor. Here no code is ever decoded. With code = b0 + 2 b1, any 4-entry
codebook row is exactly
    cb[j, code] = c0_j + d1_j b0 + d2_j b1 + d3_j (b0 b1),
    d1 = cb1 - cb0,  d2 = cb2 - cb0,  d3 = cb3 - cb2 - cb1 + cb0,
so for keys   s_t = q'.k'_t = sum_j q'_j c0_j  +  sum_{type} (q' * d_type) . plane_type_t
and for values  o'_j = c0_j sum_t p_t  +  sum_{type} d_type_j (sum_t p_t plane_type_t,j).
Each "plane" is a 0/1 matrix [tokens, Q] per channel group, got from the packed code bytes by a shift and a mask
(four codes per 32-bit instruction through inline PTX on the GPU), and each product is an int8 x int8 -> int32 dot
on the tensor cores: three per channel group and per side.

Precision: int8 operands are split into two digits (x ~= hi + lo / 256, both int8, the two dots summed exactly in
int32 as 256 hi + lo): ~15 bits, finer than bf16. The folded query q' * d_type gets one scale per row (all types);
probabilities enter the value dot relative to the block's own row maximum, x = 127 exp(s - max_block s), with
exp(max_block s - m) / (127 * 256) applied to the int32 product. On random caches (relative L2 error against the f32
reference): two digits everywhere ~2e-3 (as the bf16 "mma" form); one query digit (`query_digits=1`, half the
query's registers) ~6e-3; one probability digit ~1.5e-2 (flat attention: many small probabilities per block), so
probabilities always take two.

Needs H >= 128: the int8 dots over H/4 = 16 channels (H = 64) gave wrong results under XLA's Triton on the H200, so
H = 64 is rejected (`default_config` picks "mma" there). `heads_per_program` > 1 stacks several kv heads' query rows
block-diagonally into the 16-row tile; measured no gain (registers). H200 numbers: benchmarks/notes_decode_attention.md.

Two kernels share the wrapper: `_bitplane_kernel` (one dot per operand digit) and `_compact_kernel`
(`compact_rows=True`, the default): the tile's padding rows carry the second digit (query digit 2 in the key dots'
rows G..2G-1, probability digit 2 in the value dots' rows G..2G-1), the 16 score rows are folded to the G real ones
once per block and the softmax runs on [G, block]. With symmetric codebooks (d3 = 0, `symmetric_codebooks=True`)
both skip the b0 b1 plane type.

Partials (per split): acc [1 + T slots, 4 planes, GP, Q] f32 — slot 0 the plain bf16-value accumulator of the
residual window's program, slots 1..T sum_t p_t plane_type (compact: first digit in rows < G, second in G..2G-1,
combined by `merge_compact_rows`) — acco [GP, OP], m, l [GP]; `merge_bitplane_partials` applies the value codebooks
(c0 l_compressed + sum_type d_type * slot), the outliers, the log-sum-exp weights and U_v^T. With
`values_in_kernel` (compact rows) each program applies the codebooks, the digits' weights and the outliers itself and
writes o [4, G, Q] (rotated, not yet divided by l), m, l [R]; `merge_rotated_partials` only weighs and rotates back.
The compact kernel's query inputs come from XLA (`prepare_bitplane_query` + `compact_query`) or, with
`pallas_prologue`, from one small Pallas kernel (`oskvp_decode_prologue.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.oskvp_decode_attention import (MMA_ROWS, NEG_INF, DecodeBlockConfig, default_num_splits,
                                                   fp8_rows, nonzero_denominator, poison_outputs, run_blocks,
                                                   split_range, window_attention)
from pallas_kernels.oskvp_decode_prologue import compact_query_pallas

PLANE_TYPES = 3  # b0, b1, b0 & b1; symmetric codebooks (d3 = 0) need the first two only


def codebook_deltas(cb: jax.Array) -> jax.Array:
  """cb f32 [..., H, 4] -> [..., 4, H]: (c0, d1, d2, d3) with cb[c] = c0 + d1 b0 + d2 b1 + d3 b0 b1, c = b0 + 2 b1."""
  cb = cb.astype(jnp.float32)
  c0, c1, c2, c3 = (cb[..., i] for i in range(4))
  return jnp.stack([c0, c1 - c0, c2 - c0, c3 - c2 - c1 + c0], axis=-2)


def multilinear_coefficients(cb: jax.Array) -> jax.Array:
  """cb f32 [..., H, L], L = 4 or 8 levels -> a [..., L, H] with cb[c] = sum_m a_m prod_{i in m} b_i over the bit sets
  m (as integers 0..L-1) of code c = b0 + 2 b1 (+ 4 b2); a_0 = cb[0]. For L = 4 these are `codebook_deltas`."""
  a = cb.astype(jnp.float32)
  idx = jnp.arange(a.shape[-1])
  for i in range(a.shape[-1].bit_length() - 1):  # Moebius inversion over the subsets, one bit at a time
    a = jnp.where(idx & (1 << i) != 0, a - a[..., idx ^ (1 << i)], a)
  return jnp.swapaxes(a, -1, -2)


def symmetric_coefficients_3bit(cb: jax.Array) -> jax.Array:
  """Symmetric 8-level rows cb f32 [..., H, 8] (cb[c] + cb[7 - c] the same for every c) -> [..., 5, H]:
  (c0, d0, d1, d2, dp) with cb[c] = c0 + d0 b0 + d1 b1 + d2 b2 + dp (b0 ^ b1 ^ b2).

  In the signs s_i = 2 b_i - 1 any row is w + sum_S w_S prod_{i in S} s_i (Walsh); complementing every bit maps c to
  7 - c and flips the sign of the odd terms only, so a symmetric row has no even term but w, and
  s0 s1 s2 = 2 (b0 ^ b1 ^ b2) - 1. Wrong results for rows that are not symmetric (`oskvp.symmetric_codebooks`).
  """
  cb = cb.astype(jnp.float32)
  c = np.arange(8)
  s = [2 * ((c >> i) & 1) - 1 for i in range(3)]
  walsh = lambda sign: (cb * jnp.asarray(sign, jnp.float32)).mean(axis=-1)  # [..., H]  # noqa: E731
  w0, w1, w2, w012 = walsh(s[0]), walsh(s[1]), walsh(s[2]), walsh(s[0] * s[1] * s[2])
  return jnp.stack([cb.mean(axis=-1) - w0 - w1 - w2 - w012, 2 * w0, 2 * w1, 2 * w2, 2 * w012], axis=-2)


def key_plane_coefficients(cb: jax.Array, types: int) -> jax.Array:
  """Key codebooks cb [..., H, L] -> [..., 1 + types, H]: the constant and one coefficient per plane type the kernel
  reads: 4 levels, 3 types (or 2: symmetric, d3 = 0); 8 levels, 7 types (`KEY_TYPES_3BIT`) or 4 (symmetric,
  `KEY_TYPES_3BIT_SYMMETRIC`)."""
  if cb.shape[-1] == 8 and types == KEY_TYPES_3BIT_SYMMETRIC:
    return symmetric_coefficients_3bit(cb)
  return multilinear_coefficients(cb)[..., :1 + types, :]


# ----------------------------------------------------------------------------------------------------------------
# Planes: 0/1 int8 matrices from the packed code bytes.

def _plane_asm(plane: int, kind: int) -> str:
  """PTX for 4 packed code bytes -> 4 int8 0/1 values of bit-plane `kind` (0: b0, 1: b1, 2: b0 & b1) of `plane`."""
  lo, hi = 2 * plane, 2 * plane + 1
  if kind == 0:
    return f"{{ .reg .b32 t; shr.b32 t, $1, {lo}; and.b32 $0, t, 0x01010101; }}" if lo else \
        "and.b32 $0, $1, 0x01010101;"
  if kind == 1:
    return f"{{ .reg .b32 t; shr.b32 t, $1, {hi}; and.b32 $0, t, 0x01010101; }}"
  shift_lo = f"shr.b32 t, $1, {lo}; " if lo else "mov.b32 t, $1; "
  # lop3 immediate 0x80 = a & b & c.
  return f"{{ .reg .b32 t, u; {shift_lo}shr.b32 u, $1, {hi}; lop3.b32 $0, t, u, 0x01010101, 0x80; }}"


def _masked_plane_asm(plane: int, kind: int) -> str:
  """PTX for 4 packed code bytes -> plane `kind` of `plane` left in place: each byte 0 or its bit's weight."""
  lo = 2 * plane
  if kind < 2:
    return f"and.b32 $0, $1, {(1 << (lo + kind)) * 0x01010101:#010x};"
  # b0 & b1 at b0's position: x & (x >> 1) & mask (lop3 immediate 0x80 = a & b & c).
  return f"{{ .reg .b32 u; shr.b32 u, $1, 1; lop3.b32 $0, $1, u, {(1 << lo) * 0x01010101:#010x}, 0x80; }}"


def masked_plane_scales(plane: int, types: int = PLANE_TYPES) -> list[float]:
  """What `planes(..., masked=True)` multiplied each plane type by, inverted: b0 sits at 4**p, b1 at 2 * 4**p (int8
  -128 for p = 3: the sign is in the scale), b0 & b1 at 4**p. Exact powers of two."""
  s = [4.0**-plane, 0.5 * 4.0**-plane, 4.0**-plane]
  if plane == 3:
    s[1] = -s[1]
  return s[:types]


def planes(x: jax.Array, plane: int, extract: str, types: int = PLANE_TYPES, masked: bool = False) -> list[jax.Array]:
  """x uint8 [bs, Q] packed code bytes -> the first `types` of [b0, b1, b0 & b1] of `plane`, int8 [bs, Q], 0/1.

  masked: the bits are not shifted down, only masked (one instruction per 4 codes instead of two): each plane comes
  out multiplied by 1 / `masked_plane_scales(plane)`, which the caller folds into its int32 -> f32 scale.
  """
  if extract == "asm":  # four codes per 32-bit instruction (GPU only: inline PTX has no interpreter)
    out = [jax.ShapeDtypeStruct(x.shape, jnp.int8)]
    asm = _masked_plane_asm if masked else _plane_asm
    return [plgpu.elementwise_inline_asm(asm(plane, kind), args=[x], constraints="=r,r", pack=4,
                                         result_shape_dtypes=out)[0] for kind in range(types)]
  if masked:
    lo = 2 * plane
    return [(x & m).astype(jnp.int8) for m in (1 << lo, 2 << lo)[:types]] + \
        ([(x & (x >> 1) & (1 << lo)).astype(jnp.int8)] if types > 2 else [])
  b0 = (x >> 2 * plane) & 1
  b1 = (x >> (2 * plane + 1)) & 1
  return [b.astype(jnp.int8) for b in (b0, b1, b0 & b1)[:types]]


KEY_TYPES_3BIT = 7  # b0, b1, b0 b1, b2, b0 b2, b1 b2, b0 b1 b2: type t is the bit set t + 1
KEY_TYPES_3BIT_SYMMETRIC = 4  # b0, b1, b2, b0 ^ b1 ^ b2 (`symmetric_coefficients_3bit`)


def high_bit_tile(ref, rows, valid, q_dim: int) -> jax.Array:
  """The third code bits of `rows` as uint8 [bs, Q], column i holding byte i mod Q/2 (a gathered load: each byte
  serves two columns of every plane). `pack1` puts channel p Q + i at bit 2 p + (i >= Q/2) of byte i mod Q/2."""
  cols = jnp.arange(q_dim) % (q_dim // 2)
  return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0)


def key_planes_3bit(codes: jax.Array, high: jax.Array, plane: int, extract: str,
                    symmetric: bool = False) -> list[jax.Array]:
  """codes uint8 [bs, Q] (2-bit, packed), high uint8 [bs, Q] (`high_bit_tile`) -> the int8 0/1 planes of `plane`:
  the 7 of `KEY_TYPES_3BIT`, or with symmetric codebooks the 4 of `KEY_TYPES_3BIT_SYMMETRIC`."""
  q_dim = codes.shape[-1]
  shift = (2 * plane + (jnp.arange(q_dim) >= q_dim // 2)).astype(jnp.uint8)[None, :]  # [1, Q]
  b2 = ((high >> shift) & 1).astype(jnp.int8)
  if symmetric:
    b0, b1 = planes(codes, plane, extract, types=2)
    return [b0, b1, b2, b0 ^ b1 ^ b2]
  b0, b1, b01 = planes(codes, plane, extract)
  return [b0, b1, b01, b2, b0 & b2, b1 & b2, b01 & b2]


# ----------------------------------------------------------------------------------------------------------------
# Kernel.

def write_partials(acc_ref, acco_ref, m_ref, l_ref, acc, acco, m, l):
  """A program's partials: acc[slot][plane] [GP, Q] -> acc_ref [slots, 4, GP, Q]; acco, m, l as they are."""
  for t, slot in enumerate(acc):
    for p, tile in enumerate(slot):
      acc_ref[t, p] = tile
  acco_ref[...] = acco
  m_ref[...] = m
  l_ref[...] = l


def _bitplane_kernel(qhi_ref, qlo_ref, qs_ref, qc_ref, qp_ref, qo_ref, ck_ref, ok_ref, cv_ref, ov_ref, rk_ref, rv_ref,
                     nc_ref, nr_ref, acc_ref, acco_ref, m_ref, l_ref, *, num_splits: int, block_s: int, block_r: int,
                     o_dim: int, groups: int, extract: str, two_digits: bool, prefetch: bool, types: int):
  # One program serves HP kv heads of one batch row: its GP rows are (kv head h, query g) = h * G + g, and each
  # head's query sits block-diagonally (zero in the other heads' rows), so the per-row work (softmax, scaling,
  # accumulator updates) is shared by HP heads instead of padding G rows to 16.
  # qhi_ref, qlo_ref [T types (3, or 2 for symmetric codebooks), 4 planes, HP, GP, Q] int8: the two digits of q' * d_type; qs_ref [GP] f32 their
  # scale, one per row (q' * d ~= qs * (256 qhi + qlo); with one digit qlo is unused and q' * d ~= qs * qhi); qc_ref [GP] f32 = sum_j q'_j c0_j; qp_ref [4, HP, GP, Q]
  # bf16 the query planes (residual window); qo_ref [HP, GP, OP] bf16 outlier query x scale_k;
  # ck_ref, cv_ref [HP, S, Q] uint8; ok_ref, ov_ref [HP, S, O] fp8; rk_ref, rv_ref [HP, R, H] bf16; nc_ref, nr_ref [].
  # acc_ref [1 + T slots, 4 planes, GP, Q] f32; acco_ref [GP, OP] f32; m_ref, l_ref [GP] f32.
  hp, gp, q_dim = qp_ref.shape[1], qp_ref.shape[2], qp_ref.shape[3]
  split = pl.program_id(2)  # read here: interpret mode cannot see program_id inside `pl.when`.
  m0 = jnp.full((gp,), NEG_INF, jnp.float32)
  l0 = jnp.zeros((gp,), jnp.float32)
  zeros = jnp.zeros((gp, q_dim), jnp.float32)
  row_head = jnp.arange(gp) // groups  # [GP]; padding rows get heads >= HP

  def head_rows(x, h):
    """x [GP, n]: the rows of head h, zero elsewhere (no-op with one head per program)."""
    return x if hp == 1 else jnp.where((row_head == h)[:, None], x, jnp.zeros_like(x))

  write = functools.partial(write_partials, acc_ref, acco_ref, m_ref, l_ref)

  @pl.when(split < num_splits)
  def _compressed():
    start, end, nblocks = split_range(nc_ref, split, num_splits, block_s)
    qs = qs_ref[...]  # [GP] f32
    qc = qc_ref[...]  # [GP]
    op = acco_ref.shape[1]

    def load_block(i):
      """Raw tiles of block i, per head: codes [bs, Q] uint8 (K, V), outliers [bs, OP] f32 (K, V), zero past end."""
      s0 = start + i * block_s
      valid = s0 + jnp.arange(block_s) < end  # [bs]
      rows = pl.ds(s0, block_s)
      codes = lambda ref, h: plgpu.load(ref.at[jnp.int32(h), rows, :], mask=valid[:, None], other=0)
      return ([codes(ck_ref, h) for h in range(hp)], [codes(cv_ref, h) for h in range(hp)],
              [fp8_rows(ok_ref, rows, valid, o_dim, op, head=h) for h in range(hp)],
              [fp8_rows(ov_ref, rows, valid, o_dim, op, head=h) for h in range(hp)])

    def compute(i, tiles, acc, acco, m, l):
      cks, cvs, oks, ovs = tiles
      valid = start + i * block_s + jnp.arange(block_s) < end  # [bs]
      # Scores: every key dot (heads, plane types, channel groups) chained in int32 per digit (the tensor cores
      # accumulate), one conversion and one scale per row.
      scores = qc[:, None] + jnp.zeros((gp, block_s), jnp.float32)
      hi, lo = 0, 0
      for h in range(hp):
        scores += plgpu.dot(qo_ref[h], oks[h].astype(jnp.bfloat16), trans_b=True)  # [GP, bs]
        for p in range(4):
          kplanes = planes(cks[h], p, extract, types)
          for t in range(types):
            hi += plgpu.dot(qhi_ref[t, p, h], kplanes[t], trans_b=True)  # [GP, bs] int32
            if two_digits:
              lo += plgpu.dot(qlo_ref[t, p, h], kplanes[t], trans_b=True)
      scores += qs[:, None] * (hi * 256 + lo if two_digits else hi).astype(jnp.float32)
      # Online softmax, the block's probabilities as two int8 digits relative to the block's own row maximum.
      scores = jnp.where(valid[None, :], scores, NEG_INF)
      m_blk = scores.max(axis=1)
      m_new = jnp.maximum(m, m_blk)
      alpha = jnp.exp(m - m_new)
      p_blk = jnp.exp(m_blk - m_new)  # weight of the block's row maximum
      pt = jnp.exp(scores - m_blk[:, None])  # [GP, bs] in [0, 1], max 1 per row
      l = alpha * l + p_blk * pt.sum(axis=1)
      x = pt * 127.0
      p_hi = (x + 0.5).astype(jnp.int8)  # round to nearest (x >= 0)
      p_lo = ((x - p_hi.astype(jnp.float32)) * 256.0 + jnp.where(x >= p_hi, 0.5, -0.5)).astype(jnp.int8)
      pb = pt.astype(jnp.bfloat16)
      w = p_blk * (1.0 / (127.0 * 256.0))
      ov_sum = sum(plgpu.dot(head_rows(pb, h), ovs[h].astype(jnp.bfloat16)) for h in range(hp))  # [GP, OP]
      phs = [head_rows(p_hi, h) for h in range(hp)]
      pls = [head_rows(p_lo, h) for h in range(hp)]
      acco = acco * alpha[:, None] + ov_sum * p_blk[:, None]
      new = [acc[0]] + [[None] * 4 for _ in range(types)]
      for p in range(4):
        v_hi, v_lo = [0] * types, [0] * types  # int32 [GP, Q] chains over heads, per digit
        for h in range(hp):
          vplanes = planes(cvs[h], p, extract, types)
          for t in range(types):
            v_hi[t] += plgpu.dot(phs[h], vplanes[t])
            v_lo[t] += plgpu.dot(pls[h], vplanes[t])
        for t in range(types):
          new[1 + t][p] = acc[1 + t][p] * alpha[:, None] + (v_hi[t] * 256 + v_lo[t]).astype(jnp.float32) * w[:, None]
      return new, acco, m_new, l

    state0 = ([[zeros] * 4 for _ in range(1 + types)], jnp.zeros(acco_ref.shape, jnp.float32), m0, l0)
    write(*run_blocks(nblocks, load_block, compute, state0, prefetch))

  @pl.when(split == num_splits)
  def _residual():
    qp = [[qp_ref[p, h] for p in range(4)] for h in range(hp)]  # [GP, Q] bf16, block-diagonal over heads
    acc, m, l = window_attention(nr_ref[()], block_r, qp, rk_ref, rv_ref, [zeros] * 4, m0, l0, head_rows)
    write([acc] + [[zeros] * 4 for _ in range(types)], jnp.zeros(acco_ref.shape, jnp.float32), m, l)


def _compact_kernel(qd_ref, qw_ref, qc_ref, qp_ref, qo_ref, ck_ref, ok_ref, cv_ref, ov_ref, rk_ref, rv_ref, *refs,
                    num_splits: int, block_s: int, block_r: int, o_dim: int, groups: int, extract: str, types: int,
                    prefetch: bool, masked_values: bool, values_in_kernel: bool, key_high_bits: bool):
  # `compact_rows`: one kv head per program; the R = 16 tensor-core rows hold the G query rows (0..G-1) and their
  # second int8 digit (G..2G-1), so each plane's key dot yields both query digits and each value dot both
  # probability digits; the softmax runs on the G real rows only.
  # qd_ref [T, 4, R, Q] int8 (rows 0..G-1 the first digit of q' * d_type, G..2G-1 the second); qw_ref [R] f32 the
  # rows' scales (their weighted sum over the row groups is q' . d . plane); qc_ref [G] f32; qp_ref [4, R, Q] bf16
  # (residual window, rows < G); qo_ref [R, OP] bf16 (rows < G); ck_ref, cv_ref [S, Q] uint8; ok_ref, ov_ref
  # [S, O] fp8; rk_ref, rv_ref [R_window, H] bf16; nc_ref, nr_ref [].
  # acc_ref [1 + T, 4, R, Q] f32: slot 0 the window's values (rows < G); slots 1.. the value planes, digit 1 in
  # rows < G and digit 2 in rows G..2G-1 (merged as 256 x first + second); acco_ref [R, OP]; m_ref, l_ref [R].
  # values_in_kernel: refs are (cbv_ref [H, 4] value codebook rows, sv_ref [O] f32 value outlier scales, nc_ref,
  # nr_ref, o_ref [4, G, Q] f32 the program's rotated output, not yet divided by l, m_ref, l_ref [R]): the value
  # codebooks, the digits' weights and the outliers are applied here, and the merge only weighs and rotates back.
  # key_high_bits (3-bit keys): refs start with hk_ref [S, Q/2] uint8, the keys' third code bits; qd_ref then holds
  # the seven key plane types of `KEY_TYPES_3BIT` ([7, 4, R, Q]), or with symmetric codebooks (types = 2) the four of
  # `KEY_TYPES_3BIT_SYMMETRIC`; the values keep `types`.
  hk_ref = None
  if key_high_bits:
    hk_ref, *refs = refs
  if values_in_kernel:
    cbv_ref, sv_ref, nc_ref, nr_ref, o_ref, m_ref, l_ref = refs
  else:
    nc_ref, nr_ref, acc_ref, acco_ref, m_ref, l_ref = refs
  r, q_dim = qw_ref.shape[0], qp_ref.shape[2]
  n_groups = r // groups
  split = pl.program_id(2)  # read here: interpret mode cannot see program_id inside `pl.when`.
  zeros = jnp.zeros((r, q_dim), jnp.float32)

  def fold(x):
    """[R, n] -> [G, n]: the sum of the R/G row groups."""
    return x.reshape(n_groups, groups, x.shape[-1]).sum(axis=0)

  def unfold(parts, dtype):
    """[G, n] arrays -> [R, n] with part i in rows iG..iG+G-1, zero elsewhere."""
    n = parts[0].shape[-1]
    sel = lax.broadcasted_iota(jnp.int32, (n_groups, groups, n), 0)
    out = jnp.zeros((n_groups, groups, n), dtype)
    for i, part in enumerate(parts):
      out = jnp.where(sel == i, jnp.broadcast_to(part.astype(dtype)[None], out.shape), out)
    return out.reshape(r, n)

  def first_group(x):
    """[R, n] -> [G, n]: rows 0..G-1."""
    sel = lax.broadcasted_iota(jnp.int32, (n_groups, groups, x.shape[-1]), 0)
    return jnp.where(sel == 0, x.reshape(n_groups, groups, x.shape[-1]), 0.0).sum(axis=0)

  def write_values(acc, acco, m, l, l_comp):
    """o[p] = c0_p l_comp + slot 0 + sum_type d_type,p * (the value digits folded) (+ the outliers of plane p)."""
    op = acco.shape[1]
    scale = plgpu.load(sv_ref.at[pl.ds(0, op)], mask=jnp.arange(op) < o_dim, other=0.0)  # [OP]
    for p in range(4):
      cb = [cbv_ref[pl.ds(p * q_dim, q_dim), c].astype(jnp.float32)[None, :] for c in range(4)]  # [1, Q] each
      deltas = [cb[1] - cb[0], cb[2] - cb[0], cb[3] - cb[2] - cb[1] + cb[0]]
      o = first_group(acc[0][p]) + l_comp[:, None] * cb[0]
      for t in range(types):
        o += deltas[t] * fold(acc[1 + t][p])
      if p * q_dim < op:  # outlier channel j < O sits in plane j // Q, column j % Q: place [R, OP] into [R, Q]
        place = (jnp.arange(op)[:, None] == p * q_dim + jnp.arange(q_dim)[None, :]).astype(jnp.float32)  # [OP, Q]
        o += first_group(((acco * scale[None, :])[:, :, None] * place[None]).sum(axis=1))
      o_ref[p] = o
    m_ref[...] = m
    l_ref[...] = l

  def write(acc, acco, m, l, l_comp):
    """m, l [R]; l_comp [G] the probability mass of compressed tokens (the c0 term of the value codebooks)."""
    if values_in_kernel:
      write_values(acc, acco, m, l, l_comp)
    else:
      write_partials(acc_ref, acco_ref, m_ref, l_ref, acc, acco, m, l)
  op = qo_ref.shape[1]
  # The value digits' weights: 256 x first + second, in the kernel's per-row scale or in the merge.
  hi_weight = 256.0 if values_in_kernel else 1.0

  @pl.when(split < num_splits)
  def _compressed():
    start, end, nblocks = split_range(nc_ref, split, num_splits, block_s)
    qw, qc = qw_ref[...], qc_ref[...]  # [R], [G]

    def load_block(i):
      s0 = start + i * block_s
      valid = s0 + jnp.arange(block_s) < end  # [bs]
      rows = pl.ds(s0, block_s)
      codes = lambda ref: plgpu.load(ref.at[rows, :], mask=valid[:, None], other=0)
      odt = qo_ref.dtype  # float16 (outliers converted straight from e4m3) or bfloat16
      high = high_bit_tile(hk_ref, s0 + jnp.arange(block_s), valid, q_dim) if key_high_bits else None
      return (codes(ck_ref), codes(cv_ref), fp8_rows(ok_ref, rows, valid, o_dim, op, dtype=odt),
              fp8_rows(ov_ref, rows, valid, o_dim, op, dtype=odt), high)

    def compute(i, tiles, acc, acco, m, l):
      ck, cv, ok, ov, high = tiles
      valid = start + i * block_s + jnp.arange(block_s) < end  # [bs]
      idot = 0
      for p in range(4):
        kplanes = (key_planes_3bit(ck, high, p, extract, symmetric=types == 2) if key_high_bits
                   else planes(ck, p, extract, types))
        for t, kplane in enumerate(kplanes):
          idot += plgpu.dot(qd_ref[t, p], kplane, trans_b=True)  # [R, bs] int32, both digits
      sr = idot.astype(jnp.float32) * qw[:, None] + plgpu.dot(qo_ref[...], ok, trans_b=True)
      scores = jnp.where(valid[None, :], fold(sr) + qc[:, None], NEG_INF)  # [G, bs]
      m_blk = scores.max(axis=1)
      m_new = jnp.maximum(m, m_blk)
      alpha = jnp.exp(m - m_new)
      p_blk = jnp.exp(m_blk - m_new)
      pt = jnp.exp(scores - m_blk[:, None])  # [G, bs] in [0, 1], max 1 per row
      l = alpha * l + p_blk * pt.sum(axis=1)
      x = pt * 127.0
      p_hi = (x + 0.5).astype(jnp.int8)
      p_lo = ((x - p_hi.astype(jnp.float32)) * 256.0 + jnp.where(x >= p_hi, 0.5, -0.5)).astype(jnp.int8)
      pd = unfold([p_hi, p_lo], jnp.int8)  # [R, bs]
      col = lambda v: v[:, None]
      alpha_r = unfold([col(alpha), col(alpha)], jnp.float32)  # [R, 1]
      p_blk_r = unfold([col(p_blk), col(p_blk)], jnp.float32)
      w_r = unfold([col(p_blk * hi_weight), col(p_blk)], jnp.float32) * (1.0 / (127.0 * 256.0))
      pb = unfold([pt], ov.dtype)
      acco = acco * alpha_r + plgpu.dot(pb, ov) * p_blk_r
      new = [acc[0]] + [[None] * 4 for _ in range(types)]
      for p in range(4):
        vplanes = planes(cv, p, extract, types, masked_values)
        scales = masked_plane_scales(p, types) if masked_values else [1.0] * types
        for t in range(types):
          new[1 + t][p] = acc[1 + t][p] * alpha_r + plgpu.dot(pd, vplanes[t]).astype(jnp.float32) * (w_r * scales[t])
      return new, acco, m_new, l

    state0 = ([[zeros] * 4 for _ in range(1 + types)], jnp.zeros((r, op), jnp.float32),
              jnp.full((groups,), NEG_INF, jnp.float32), jnp.zeros((groups,), jnp.float32))
    acc, acco, m, l = run_blocks(nblocks, load_block, compute, state0, prefetch)
    write(acc, acco, unfold([m[:, None]], jnp.float32).reshape(r), unfold([l[:, None]], jnp.float32).reshape(r), l)

  @pl.when(split == num_splits)
  def _residual():
    qp = [[qp_ref[p] for p in range(4)]]
    acc, m, l = window_attention(nr_ref[()], block_r, qp, rk_ref, rv_ref, [zeros] * 4,
                                 jnp.full((r,), NEG_INF, jnp.float32), jnp.zeros((r,), jnp.float32))
    # No codebook mass here: the window's values are plain bf16.
    write([acc] + [[zeros] * 4 for _ in range(types)], jnp.zeros((r, op), jnp.float32), m, l,
          jnp.zeros((groups,), jnp.float32))


def compact_query(qhi, qlo, qs, qc, groups: int, digits: int):
  """`prepare_bitplane_query` outputs (one head per program) -> the compact kernel's query rows.

  Returns:
    qd int8 [B, K, T, 4, R, Q] (digit 1 in rows < G, digit 2 in rows G..2G-1), qw f32 [B, K, R] the rows' scales,
    qc f32 [B, K, G].
  """
  qhi, qlo = qhi[:, :, :, :, 0], qlo[:, :, :, :, 0]  # [B, K, T, 4, R, Q]
  if digits == 1:
    return qhi, qs, qc[..., :groups]
  qd = qhi + jnp.roll(qlo, groups, axis=-2)  # disjoint rows: rows >= G of qlo are zero
  qw = qs * 256.0 + jnp.roll(qs, groups, axis=-1)
  return qd, qw, qc[..., :groups]


def merge_compact_rows(acc, groups: int):
  """[..., 1 + T, 4, R, Q] compact partials -> [..., 1 + T, 4, G, Q]: the value digits combined (256 x first + second)."""
  first = acc[..., :groups, :]
  second = acc[..., groups:2 * groups, :]
  return jnp.concatenate([first[..., :1, :, :, :], 256.0 * first[..., 1:, :, :, :] + second[..., 1:, :, :, :]],
                         axis=-4)


# ----------------------------------------------------------------------------------------------------------------
# Wrapper.


def heads_per_program(kv_heads: int, requested: int | None = None) -> int:
  """kv heads one program serves (default 1), lowered to a divisor of K."""
  hp = min(requested or 1, kv_heads)
  while kv_heads % hp:
    hp -= 1
  return hp


def block_diagonal(x: jax.Array, hp: int, rows: int) -> jax.Array:
  """x [B, K, ..., G, C] -> [B, K / hp, ..., hp, rows, C]: head h's G rows at rows h*G.., zero elsewhere."""
  b, k, *mid, g, c = x.shape
  x = x.reshape(b, k // hp, hp, *mid, g, c)
  x = jnp.moveaxis(x, 2, -3)  # [B, KG, ..., hp, G, C]
  eye = jnp.eye(hp, dtype=x.dtype)
  bd = x[..., None, :, :, :] * eye[:, :, None, None]  # [B, KG, ..., hp (slot), hp (head), G, C]
  bd = bd.reshape(*bd.shape[:-3], hp * g, c)
  return jnp.pad(bd, [(0, 0)] * (bd.ndim - 2) + [(0, rows - hp * g), (0, 0)])


def group_rows(x: jax.Array, hp: int, rows: int) -> jax.Array:
  """x [B, K, G] -> [B, K / hp, rows]: row h*G + g holds head h's query g, zero padded."""
  b, k, g = x.shape
  return jnp.pad(x.reshape(b, k // hp, hp * g), ((0, 0), (0, 0), (0, rows - hp * g)))


def prepare_bitplane_query(q, u_k, cb_k, scale_k, kv_heads: int, hp: int, rows: int, o_cols: int,
                           digits: int = 2, types: int = PLANE_TYPES):
  """q [B, N, H] -> the kernel's query inputs (see `_bitplane_kernel`), KG = K / hp programs per batch row.

  Returns:
    qhi, qlo int8 [B, KG, T, 4, hp, rows, Q] (T = types); qs f32 [B, KG, rows] with q' * d ~= qs * (256 qhi + qlo) (two
    digits) or qs * qhi (one digit; qlo is then zero);
    qc f32 [B, KG, rows]; q_planes bf16 [B, KG, 4, hp, rows, Q]; q_outl bf16 [B, KG, hp, rows, o_cols].
  """
  b, n, h = q.shape
  g = n // kv_heads
  hi = lax.Precision.HIGHEST
  qr = jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32).reshape(b, kv_heads, g, h), u_k, precision=hi) * h**-0.5
  deltas = key_plane_coefficients(cb_k, types)  # [B, K, 1 + T, H]
  qc = jnp.einsum("BKGH,BKH->BKG", qr, deltas[:, :, 0], precision=hi)
  qd = qr[:, :, None] * deltas[:, :, 1:1 + types, None, :]  # [B, K, T, G, H]
  # One scale per row for all T types, so the kernel sums every key dot in int32 and converts once.
  qs = jnp.maximum(jnp.abs(qd).max(axis=(2, 4)), 1e-30) / 127.0  # [B, K, G]
  x = qd / qs[:, :, None, :, None]  # in [-127, 127]
  q_hi = jnp.round(x)
  q_lo = jnp.clip(jnp.round((x - q_hi) * 256.0), -127, 127)  # |x - hi| <= 0.5: |lo| <= 128, clipped to int8
  if digits == 1:
    q_lo, qs = jnp.zeros_like(q_lo), qs * 256.0
  by_plane = lambda a: a.reshape(*a.shape[:-1], 4, h // 4).swapaxes(-3, -2)  # [..., G, H] -> [..., 4, G, Q]
  digits = [block_diagonal(by_plane(d), hp, rows).astype(jnp.int8) for d in (q_hi, q_lo)]
  q_planes = block_diagonal(by_plane(qr), hp, rows).astype(jnp.bfloat16)
  q_outl = qr[..., :scale_k.shape[-1]] * scale_k[:, :, None, :]
  q_outl = jnp.pad(q_outl, ((0, 0), (0, 0), (0, 0), (0, o_cols - q_outl.shape[-1])))
  q_outl = block_diagonal(q_outl, hp, rows).astype(jnp.bfloat16)
  return (*digits, group_rows(qs, hp, rows) / 256.0, group_rows(qc, hp, rows), q_planes, q_outl)


def ungroup_rows(x: jax.Array, hp: int, groups: int) -> jax.Array:
  """[B, KG, NS, ..., rows, C?] partials with rows (head, g) -> [B, KG * hp, NS, ..., G, C?] per kv head."""
  b, kg, ns = x.shape[:3]
  if x.ndim == 4:  # m, l: [B, KG, NS, rows]
    x = x[..., :hp * groups].reshape(b, kg, ns, hp, groups)
    return jnp.moveaxis(x, 3, 2).reshape(b, kg * hp, ns, groups)
  x = x[..., :hp * groups, :]
  x = x.reshape(*x.shape[:-2], hp, groups, x.shape[-1])
  x = jnp.moveaxis(x, -3, 2)  # [B, KG, hp, NS, ..., G, C]
  return x.reshape(b, kg * hp, *x.shape[3:])


def merge_bitplane_partials(acc, acco, m, l, cb_v, scale_v, u_v, groups: int, dtype):
  """Log-sum-exp merge over splits, value codebooks applied, rotation back.

  Args:
    acc [B, K, NS+1, 1 + T, 4, GP, Q] (slot, plane), acco [B, K, NS+1, GP, >= O], m, l [B, K, NS+1, GP] (f32), the
      last split being the residual window's; cb_v [B, K, H, 4]; scale_v [B, K, O]; u_v [B, K, H, H].

  Returns:
    [B, N, H] in dtype.
  """
  b, kh, ns1, n_slots, _, _, qd = acc.shape
  h, o_dim = 4 * qd, scale_v.shape[-1]
  hi = lax.Precision.HIGHEST
  acc, acco, m, l = acc[..., :groups, :], acco[..., :groups, :o_dim], m[..., :groups], l[..., :groups]
  w = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, K, NS+1, G]
  denom = (w * l).sum(axis=2)  # [B, K, G]
  slots = jnp.einsum("BKSG,BKSTPGQ->BKTGPQ", w, acc, precision=hi).reshape(b, kh, n_slots, groups, h)
  deltas = codebook_deltas(cb_v)  # [B, K, 4, H]: c0, d1, d2, d3
  l_comp = (w[:, :, :ns1 - 1] * l[:, :, :ns1 - 1]).sum(axis=2)  # [B, K, G] probability mass of the store
  o_rot = slots[:, :, 0] + l_comp[..., None] * deltas[:, :, None, 0]
  o_rot += jnp.einsum("BKTGH,BKTH->BKGH", slots[:, :, 1:], deltas[:, :, 1:n_slots], precision=hi)
  o_out = jnp.einsum("BKSG,BKSGO->BKGO", w, acco, precision=hi) * scale_v[:, :, None, :]
  o_rot = o_rot.at[..., :o_dim].add(o_out) / nonzero_denominator(denom)[..., None]
  o = jnp.einsum("BKGJ,BKHJ->BKGH", o_rot, u_v, precision=hi)
  return o.reshape(b, kh * groups, h).astype(dtype)


def merge_rotated_partials(o, m, l, u_v, dtype):
  """Log-sum-exp merge of per-program rotated outputs (`values_in_kernel`) and rotation back.

  Args:
    o [B, K, NS+1, 4, G, Q] f32 (not divided by l); m, l [B, K, NS+1, >= G] f32; u_v [B, K, H, H].

  Returns:
    [B, N, H] in dtype.
  """
  b, kh, _, _, g, qd = o.shape
  m, l = m[..., :g], l[..., :g]
  w = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, K, NS+1, G]
  o_rot = jnp.einsum("BKSG,BKSPGQ->BKGPQ", w, o, precision=lax.Precision.HIGHEST).reshape(b, kh, g, 4 * qd)
  o_rot = o_rot / nonzero_denominator((w * l).sum(axis=2))[..., None]
  out = jnp.einsum("BKGJ,BKHJ->BKGH", o_rot, u_v, precision=lax.Precision.HIGHEST)
  return out.reshape(b, kh * g, 4 * qd).astype(dtype)


@functools.partial(jax.jit, static_argnames=["interpret", "config", "poison", "symmetric_codebooks"])
def oskvp_bitplane_pallas(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v,
                          n_comp, n_res, hi_k=None, *, interpret: bool, config: DecodeBlockConfig,
                          poison: bool = False, symmetric_codebooks: bool = False):
  """The bit-plane kernel (arguments as `oskvp_decode_attention`, lengths already clipped to S and R by
  `_oskvp_pallas`, its one caller; partials poisoned with NaN if `poison`).

  hi_k: the keys' third code bits (3-bit keys, cb_k [B, K, H, 8]) or None; needs compact rows. The keys then take
  seven plane types (`KEY_TYPES_3BIT`; four with symmetric codebooks) from the 2-bit codes and a gathered tile of
  these bits.

  symmetric_codebooks: every 4-level row has cb0 + cb3 = cb1 + cb2 (d3 = 0, `oskvp.fit(symmetric=True)`), so the
  b0 & b1 plane is skipped on both sides: a third fewer dots and accumulators. Wrong results if the rows are not.
  """
  b, n, h = q.shape
  _, kh, s, qd = codes_k.shape
  g, o_dim, r = n // kh, outl_k.shape[-1], res_k.shape[2]
  if qd < 32:
    raise ValueError(f"form='bitplane' needs head dim >= 128 (got {h}): int8 tensor-core dots over H/4 = {qd} "
                     "channels gave wrong results under XLA's Triton on the H200; use form='mma'")
  extract = "jnp" if interpret else config.extract  # inline PTX has no interpreter
  hp = heads_per_program(kh, config.heads_per_program)
  kg = kh // hp
  ns = config.num_splits or default_num_splits(b, kg, s, config.block_s)
  block_r = min(config.block_s, max(16, pl.next_power_of_2(r)))
  rows = max(pl.next_power_of_2(hp * g), MMA_ROWS)
  o_cols = max(pl.next_power_of_2(o_dim), MMA_ROWS)
  types = PLANE_TYPES - 1 if symmetric_codebooks else PLANE_TYPES
  key_high_bits = hi_k is not None
  if key_high_bits and not config.compact_rows:
    raise ValueError("hi_k (3-bit keys) needs compact_rows=True")
  key_types = types
  if key_high_bits:
    key_types = KEY_TYPES_3BIT_SYMMETRIC if symmetric_codebooks else KEY_TYPES_3BIT
  values_in_kernel = (not symmetric_codebooks) if config.values_in_kernel is None else config.values_in_kernel
  prologue = config.compact_rows and config.pallas_prologue
  if prologue:  # the query inputs come from the Pallas prologue below
    qhi = qlo = qs = qc = q_planes = q_outl = None
  else:
    qhi, qlo, qs, qc, q_planes, q_outl = prepare_bitplane_query(q, u_k, cb_k, scale_k, kh, hp, rows, o_cols,
                                                                config.query_digits, key_types)
  kernel = functools.partial(_bitplane_kernel, num_splits=ns, block_s=config.block_s, block_r=block_r, o_dim=o_dim,
                             groups=g, extract=extract, two_digits=config.query_digits == 2,
                             prefetch=config.prefetch, types=types)

  def per_head(*tail):
    return pl.BlockSpec((None, None, *tail), lambda i, j, t: (i, j) + (0,) * len(tail))

  def per_group(*tail):  # hp consecutive kv heads of a cache array [B, K, ...]
    return pl.BlockSpec((None, hp, *tail), lambda i, j, t: (i, j) + (0,) * len(tail))

  def per_row():
    return pl.BlockSpec((None,), lambda i, j, t: (i,))

  def per_prog(*tail):
    return pl.BlockSpec((None, None, None, *tail), lambda i, j, t: (i, j, t) + (0,) * len(tail))

  out_shape = [jax.ShapeDtypeStruct((b, kg, ns + 1, 1 + types, 4, rows, qd), jnp.float32),
               jax.ShapeDtypeStruct((b, kg, ns + 1, rows, o_cols), jnp.float32),
               jax.ShapeDtypeStruct((b, kg, ns + 1, rows), jnp.float32),
               jax.ShapeDtypeStruct((b, kg, ns + 1, rows), jnp.float32)]
  out_specs = [per_prog(1 + types, 4, rows, qd), per_prog(rows, o_cols), per_prog(rows), per_prog(rows)]
  in_specs = [per_head(types, 4, hp, rows, qd), per_head(types, 4, hp, rows, qd), per_head(rows),
              per_head(rows), per_head(4, hp, rows, qd), per_head(hp, rows, o_cols), per_group(s, qd),
              per_group(s, o_dim), per_group(s, qd), per_group(s, o_dim), per_group(r, h), per_group(r, h),
              per_row(), per_row()]
  inputs = [qhi, qlo, qs, qc, q_planes, q_outl, codes_k, outl_k, codes_v, outl_v, res_k, res_v,
            n_comp.astype(jnp.int32), n_res.astype(jnp.int32)]
  if config.compact_rows:
    if 2 * g > rows:
      raise ValueError(f"compact_rows needs 2 G <= {rows} rows (got G = {g})")
    odt = jnp.float16 if config.outlier_f16 else jnp.bfloat16
    if prologue:
      qdig, qw, qc, qp, qo = compact_query_pallas(q, u_k, cb_k, scale_k, rows=rows, o_cols=o_cols, types=key_types,
                                                  digits=config.query_digits, outlier_dtype=odt,
                                                  interpret=interpret)
    else:
      qdig, qw, qc = compact_query(qhi, qlo, qs, qc, g, config.query_digits)
      qp, qo = q_planes[:, :, :, 0], q_outl[:, :, 0].astype(odt)
    kernel = functools.partial(_compact_kernel, num_splits=ns, block_s=config.block_s, block_r=block_r, o_dim=o_dim,
                               groups=g, extract=extract, types=types, prefetch=config.prefetch,
                               masked_values=config.masked_value_planes, values_in_kernel=values_in_kernel,
                               key_high_bits=key_high_bits)
    in_specs = [per_head(key_types, 4, rows, qd), per_head(rows), per_head(g), per_head(4, rows, qd),
                per_head(rows, o_cols), per_head(s, qd), per_head(s, o_dim), per_head(s, qd), per_head(s, o_dim),
                per_head(r, h), per_head(r, h)] + in_specs[12:]
    inputs = [qdig, qw, qc, qp, qo] + inputs[6:]
    if key_high_bits:  # hk_ref right after rv_ref
      in_specs = in_specs[:11] + [per_head(s, qd // 2)] + in_specs[11:]
      inputs = inputs[:11] + [hi_k] + inputs[11:]
    if values_in_kernel:
      n_in = 12 if key_high_bits else 11
      in_specs = in_specs[:n_in] + [per_head(h, 4), per_head(o_dim)] + in_specs[n_in:]
      inputs = inputs[:n_in] + [cb_v, scale_v.astype(jnp.float32)] + inputs[n_in:]
      out_shape = [jax.ShapeDtypeStruct((b, kh, ns + 1, 4, g, qd), jnp.float32)] + out_shape[2:]
      out_specs = [per_prog(4, g, qd)] + out_specs[2:]
  aliases = {}
  if poison:
    kernel, inputs, in_specs, aliases = poison_outputs(kernel, inputs, in_specs, out_specs, out_shape)
  partials = pl.pallas_call(
      kernel,
      grid=(b, kg, ns + 1),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="oskvp_decode_bitplane",
  )(*inputs)
  if config.compact_rows and values_in_kernel:
    return merge_rotated_partials(*partials, u_v, q.dtype)
  acc, acco, m, l = partials
  if config.compact_rows:
    acc = merge_compact_rows(acc, g)
  acc, acco, m, l = (ungroup_rows(x, hp, g) for x in (acc, acco, m, l))
  return merge_bitplane_partials(acc, acco, m, l, cb_v, scale_v, u_v, g, q.dtype)
