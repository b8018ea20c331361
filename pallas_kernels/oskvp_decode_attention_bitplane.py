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

Precision: every int8 operand is split into two digits (x ~= hi + lo / 256, both int8, the two dots summed exactly
in int32 as 256 hi + lo): ~15 bits, finer than bf16. The folded query q' * d_type gets one scale per row (all types);
probabilities enter the value dot relative to the block's own row maximum, x = 127 exp(s - max_block s), with
exp(max_block s - m) / (127 * 256) applied to the int32 product. One digit each would halve the tensor-core work but
costs ~1.5e-2 relative error on random caches (flat attention: many small probabilities per block).

Partials (per split): acc [4 slots, 4 planes, GP, Q] f32 — slot 0 the plain bf16-value accumulator of the residual
window's program, slots 1..3 sum_t p_t plane_type — acco [GP, OP], m, l [GP]; `merge_bitplane_partials` applies the
value codebooks (c0 l_compressed + sum_type d_type * slot), the outliers, the log-sum-exp weights and U_v^T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.oskvp_decode_attention import (MMA_ROWS, NEG_INF, DecodeBlockConfig, default_num_splits,
                                                   fp8_rows, online_softmax_update, split_range)

PLANE_TYPES = 3  # b0, b1, b0 & b1


def codebook_deltas(cb: jax.Array) -> jax.Array:
  """cb f32 [..., H, 4] -> [..., 4, H]: (c0, d1, d2, d3) with cb[c] = c0 + d1 b0 + d2 b1 + d3 b0 b1, c = b0 + 2 b1."""
  cb = cb.astype(jnp.float32)
  c0, c1, c2, c3 = (cb[..., i] for i in range(4))
  return jnp.stack([c0, c1 - c0, c2 - c0, c3 - c2 - c1 + c0], axis=-2)


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


def planes(x: jax.Array, plane: int, extract: str) -> list[jax.Array]:
  """x uint8 [bs, Q] packed code bytes -> [b0, b1, b0 & b1] of `plane`, int8 [bs, Q] each, values 0/1."""
  if extract == "asm":  # four codes per 32-bit instruction (GPU only: inline PTX has no interpreter)
    out = [jax.ShapeDtypeStruct(x.shape, jnp.int8)]
    return [plgpu.elementwise_inline_asm(_plane_asm(plane, kind), args=[x], constraints="=r,r", pack=4,
                                         result_shape_dtypes=out)[0] for kind in range(PLANE_TYPES)]
  b0 = (x >> 2 * plane) & 1
  b1 = (x >> (2 * plane + 1)) & 1
  return [b.astype(jnp.int8) for b in (b0, b1, b0 & b1)]


# ----------------------------------------------------------------------------------------------------------------
# Kernel.


def _bitplane_kernel(qhi_ref, qlo_ref, qs_ref, qc_ref, qp_ref, qo_ref, ck_ref, ok_ref, cv_ref, ov_ref, rk_ref, rv_ref,
                     nc_ref, nr_ref, acc_ref, acco_ref, m_ref, l_ref, *, num_splits: int, block_s: int, block_r: int,
                     o_dim: int, extract: str):
  # qhi_ref, qlo_ref [3 types, 4 planes, GP, Q] int8: the two digits of q' * d_type; qs_ref [GP] f32 their
  # scale, one per row (q' * d ~= qs * (256 qhi + qlo)); qc_ref [GP] f32 = sum_j q'_j c0_j; qp_ref [4, GP, Q] bf16 the
  # query planes (residual window); qo_ref [GP, OP] bf16 outlier query x scale_k; ck_ref, cv_ref [S, Q] uint8;
  # ok_ref, ov_ref [S, O] fp8; rk_ref, rv_ref [R, H] bf16; nc_ref, nr_ref [] int32.
  # acc_ref [4 slots, 4 planes, GP, Q] f32; acco_ref [GP, OP] f32; m_ref, l_ref [GP] f32.
  gp, q_dim = qp_ref.shape[1], qp_ref.shape[2]
  split = pl.program_id(2)  # read here: interpret mode cannot see program_id inside `pl.when`.
  m0 = jnp.full((gp,), NEG_INF, jnp.float32)
  l0 = jnp.zeros((gp,), jnp.float32)
  zeros = jnp.zeros((gp, q_dim), jnp.float32)

  def write(acc, acco, m, l):
    for s in range(4):
      for p in range(4):
        acc_ref[s, p] = acc[s][p]
    acco_ref[...] = acco
    m_ref[...] = m
    l_ref[...] = l

  @pl.when(split < num_splits)
  def _compressed():
    start, end, nblocks = split_range(nc_ref, split, num_splits, block_s)
    qhi = [[qhi_ref[t, p] for p in range(4)] for t in range(PLANE_TYPES)]  # [GP, Q] int8
    qlo = [[qlo_ref[t, p] for p in range(4)] for t in range(PLANE_TYPES)]
    qs = qs_ref[...]  # [GP] f32
    qc = qc_ref[...]  # [GP]
    qo = qo_ref[...]  # [GP, OP] bf16
    op = acco_ref.shape[1]

    def body(i, carry):
      acc, acco, m, l = carry
      s0 = start + i * block_s
      valid = s0 + jnp.arange(block_s) < end  # [bs]
      rows = pl.ds(s0, block_s)
      ck = plgpu.load(ck_ref.at[rows, :], mask=valid[:, None], other=0)  # [bs, Q] uint8
      cv = plgpu.load(cv_ref.at[rows, :], mask=valid[:, None], other=0)
      ok = fp8_rows(ok_ref, rows, valid, o_dim, op)  # [bs, OP] f32
      ov = fp8_rows(ov_ref, rows, valid, o_dim, op)
      # Scores: per plane type, both digits summed over the 4 channel groups in int32, then one scale per row.
      scores = qc[:, None] + plgpu.dot(qo, ok.astype(jnp.bfloat16), trans_b=True)  # [GP, bs] f32
      kplanes = [planes(ck, p, extract) for p in range(4)]  # [plane][type] int8 [bs, Q]
      pairs = [(t, p) for t in range(PLANE_TYPES) for p in range(4)]
      hi = sum(plgpu.dot(qhi[t][p], kplanes[p][t], trans_b=True) for t, p in pairs)  # [GP, bs] int32
      lo = sum(plgpu.dot(qlo[t][p], kplanes[p][t], trans_b=True) for t, p in pairs)
      scores += qs[:, None] * (hi * 256 + lo).astype(jnp.float32)  # qs carries the 1/256 of the lo digit
      # Online softmax with the block's probabilities as int8, relative to the block's own row maximum.
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
      w = p_blk * (1.0 / (127.0 * 256.0))
      acco = acco * alpha[:, None] + plgpu.dot(pt.astype(jnp.bfloat16), ov.astype(jnp.bfloat16)) * p_blk[:, None]
      new = [acc[0]]
      for t in range(PLANE_TYPES):
        new.append([acc[1 + t][p] * alpha[:, None] for p in range(4)])
      for p in range(4):
        vplanes = planes(cv, p, extract)
        for t in range(PLANE_TYPES):
          pv = plgpu.dot(p_hi, vplanes[t]) * 256 + plgpu.dot(p_lo, vplanes[t])  # [GP, Q] int32
          new[1 + t][p] += pv.astype(jnp.float32) * w[:, None]
      return new, acco, m_new, l

    acc0 = [[zeros] * 4 for _ in range(4)]
    state = lax.fori_loop(0, nblocks, body, (acc0, jnp.zeros(acco_ref.shape, jnp.float32), m0, l0))
    write(*state)

  @pl.when(split == num_splits)
  def _residual():
    n = nr_ref[()]
    qp = [qp_ref[p] for p in range(4)]  # [GP, Q] bf16

    def body(i, carry):
      acc, m, l = carry
      r0 = i * block_r
      valid = r0 + jnp.arange(block_r) < n
      rows = pl.ds(r0, block_r)
      scores = jnp.zeros((gp, block_r), jnp.float32)
      for p in range(4):
        rk = plgpu.load(rk_ref.at[rows, pl.ds(p * q_dim, q_dim)], mask=valid[:, None], other=0)  # [br, Q]
        scores += plgpu.dot(qp[p], rk, trans_b=True)
      pexp, alpha, m, l = online_softmax_update(scores, valid, m, l)
      pb = pexp.astype(jnp.bfloat16)
      acc_new = []
      for p in range(4):
        rv = plgpu.load(rv_ref.at[rows, pl.ds(p * q_dim, q_dim)], mask=valid[:, None], other=0)
        acc_new.append(acc[p] * alpha[:, None] + plgpu.dot(pb, rv))
      return acc_new, m, l

    acc, m, l = lax.fori_loop(0, pl.cdiv(n, block_r), body, ([zeros] * 4, m0, l0))
    write([acc] + [[zeros] * 4 for _ in range(PLANE_TYPES)], jnp.zeros(acco_ref.shape, jnp.float32), m, l)


# ----------------------------------------------------------------------------------------------------------------
# Wrapper.


def prepare_bitplane_query(q, u_k, cb_k, scale_k, kv_heads: int, rows: int, o_cols: int):
  """q [B, N, H] -> the kernel's query inputs (see `_bitplane_kernel`), rows >= G zero-padded.

  Returns:
    qhi, qlo int8 [B, K, 3, 4, rows, Q]; qs f32 [B, K, rows] with q' * d ~= qs * (256 qhi + qlo); qc f32 [B, K, rows];
    q_planes bf16 [B, K, 4, rows, Q]; q_outl bf16 [B, K, rows, o_cols].
  """
  b, n, h = q.shape
  g = n // kv_heads
  hi = lax.Precision.HIGHEST
  qr = jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32).reshape(b, kv_heads, g, h), u_k, precision=hi) * h**-0.5
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - g), (0, 0)))  # [B, K, rows, H]
  deltas = codebook_deltas(cb_k)  # [B, K, 4, H]
  qc = jnp.einsum("BKGH,BKH->BKG", qr, deltas[:, :, 0], precision=hi)
  qd = qr[:, :, None] * deltas[:, :, 1:, None, :]  # [B, K, 3, rows, H]
  # One scale per row for all three types, so the kernel sums every key dot in int32 and converts once.
  qs = jnp.maximum(jnp.abs(qd).max(axis=(2, 4)), 1e-30) / 127.0  # [B, K, rows]
  x = qd / qs[:, :, None, :, None]  # in [-127, 127]
  q_hi = jnp.round(x)
  q_lo = jnp.clip(jnp.round((x - q_hi) * 256.0), -127, 127)  # |x - hi| <= 0.5: |lo| <= 128, clipped to int8
  split = lambda a: a.reshape(b, kv_heads, PLANE_TYPES, rows, 4, h // 4).swapaxes(3, 4).astype(jnp.int8)
  q_planes = qr.reshape(b, kv_heads, rows, 4, h // 4).swapaxes(2, 3).astype(jnp.bfloat16)
  q_outl = qr[..., :scale_k.shape[-1]] * scale_k[:, :, None, :]
  q_outl = jnp.pad(q_outl, ((0, 0), (0, 0), (0, 0), (0, o_cols - q_outl.shape[-1]))).astype(jnp.bfloat16)
  return split(q_hi), split(q_lo), qs / 256.0, qc, q_planes, q_outl


def merge_bitplane_partials(acc, acco, m, l, cb_v, scale_v, u_v, groups: int, dtype):
  """Log-sum-exp merge over splits, value codebooks applied, rotation back.

  Args:
    acc [B, K, NS+1, 4, 4, GP, Q] (slot, plane), acco [B, K, NS+1, GP, >= O], m, l [B, K, NS+1, GP] (f32), the
      last split being the residual window's; cb_v [B, K, H, 4]; scale_v [B, K, O]; u_v [B, K, H, H].

  Returns:
    [B, N, H] in dtype.
  """
  b, kh, ns1, _, _, _, qd = acc.shape
  h, o_dim = 4 * qd, scale_v.shape[-1]
  hi = lax.Precision.HIGHEST
  acc, acco, m, l = acc[..., :groups, :], acco[..., :groups, :o_dim], m[..., :groups], l[..., :groups]
  w = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, K, NS+1, G]
  denom = (w * l).sum(axis=2)  # [B, K, G]
  slots = jnp.einsum("BKSG,BKSTPGQ->BKTGPQ", w, acc, precision=hi).reshape(b, kh, 4, groups, h)
  deltas = codebook_deltas(cb_v)  # [B, K, 4, H]: c0, d1, d2, d3
  l_comp = (w[:, :, :ns1 - 1] * l[:, :, :ns1 - 1]).sum(axis=2)  # [B, K, G] probability mass of the store
  o_rot = slots[:, :, 0] + l_comp[..., None] * deltas[:, :, None, 0]
  o_rot += jnp.einsum("BKTGH,BKTH->BKGH", slots[:, :, 1:], deltas[:, :, 1:], precision=hi)
  o_out = jnp.einsum("BKSG,BKSGO->BKGO", w, acco, precision=hi) * scale_v[:, :, None, :]
  o_rot = o_rot.at[..., :o_dim].add(o_out) / denom[..., None]
  o = jnp.einsum("BKGJ,BKHJ->BKGH", o_rot, u_v, precision=hi)
  return o.reshape(b, kh * groups, h).astype(dtype)


def _drop_aliased_inputs(kernel, n_inputs, n_aliased, *refs):
  return kernel(*refs[:n_inputs], *refs[n_inputs + n_aliased:])


@functools.partial(jax.jit, static_argnames=["interpret", "config", "poison"])
def oskvp_bitplane_pallas(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v,
                          n_comp, n_res, *, interpret: bool, config: DecodeBlockConfig, poison: bool = False):
  """The bit-plane kernel (arguments as `oskvp_decode_attention`; partials poisoned with NaN if `poison`)."""
  b, n, h = q.shape
  _, kh, s, qd = codes_k.shape
  g, o_dim, r = n // kh, outl_k.shape[-1], res_k.shape[2]
  extract = "jnp" if interpret else config.extract  # inline PTX has no interpreter
  ns = config.num_splits or default_num_splits(b, kh, s, config.block_s)
  block_r = min(config.block_s, max(16, pl.next_power_of_2(r)))
  rows = max(g, MMA_ROWS)
  o_cols = max(pl.next_power_of_2(o_dim), MMA_ROWS)
  qhi, qlo, qs, qc, q_planes, q_outl = prepare_bitplane_query(q, u_k, cb_k, scale_k, kh, rows, o_cols)
  kernel = functools.partial(_bitplane_kernel, num_splits=ns, block_s=config.block_s, block_r=block_r, o_dim=o_dim,
                             extract=extract)

  def per_head(*tail):
    return pl.BlockSpec((None, None, *tail), lambda i, j, t: (i, j) + (0,) * len(tail))

  def per_row():
    return pl.BlockSpec((None,), lambda i, j, t: (i,))

  def per_prog(*tail):
    return pl.BlockSpec((None, None, None, *tail), lambda i, j, t: (i, j, t) + (0,) * len(tail))

  out_shape = [jax.ShapeDtypeStruct((b, kh, ns + 1, 4, 4, rows, qd), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, ns + 1, rows, o_cols), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, ns + 1, rows), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, ns + 1, rows), jnp.float32)]
  out_specs = [per_prog(4, 4, rows, qd), per_prog(rows, o_cols), per_prog(rows), per_prog(rows)]
  in_specs = [per_head(PLANE_TYPES, 4, rows, qd), per_head(PLANE_TYPES, 4, rows, qd), per_head(rows),
              per_head(rows), per_head(4, rows, qd), per_head(rows, o_cols), per_head(s, qd), per_head(s, o_dim),
              per_head(s, qd), per_head(s, o_dim), per_head(r, h), per_head(r, h), per_row(), per_row()]
  inputs = [qhi, qlo, qs, qc, q_planes, q_outl, codes_k, outl_k, codes_v, outl_v, res_k, res_v,
            n_comp.astype(jnp.int32), n_res.astype(jnp.int32)]
  aliases = {}
  if poison:  # Partials start as NaN (aliased in/out buffers): any element the kernel skips poisons the result.
    n_in = len(inputs)
    aliases = {n_in + i: i for i in range(4)}
    inputs += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    in_specs += out_specs
    kernel = functools.partial(_drop_aliased_inputs, kernel, n_in, len(aliases))
  acc, acco, m, l = pl.pallas_call(
      kernel,
      grid=(b, kh, ns + 1),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="oskvp_decode_bitplane",
  )(*inputs)
  return merge_bitplane_partials(acc, acco, m, l, cb_v, scale_v, u_v, g, q.dtype)
