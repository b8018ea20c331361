"""Lookup-table form of the OS-KVP decode-attention kernel (CUDA cores only, no tensor cores).

Same inputs, grid, partials and merge as `oskvp_decode_attention.py` (form="mma"), selected with
`DecodeBlockConfig(form="lut")`. Instead of dequantizing keys and calling a dot, the query is folded into the
codebook once per program:  T[p, c][g, i] = q'[g, p*Q + i] * cb[p*Q + i, c], so a key's score is a sum of table
entries picked by its codes,  s[g] = sum_{p, i} T[p, code(p, i)][g, i]  (+ the outlier term). Values are
dequantized on the fly and accumulated with broadcast multiply-adds. Query rows are the real G (no padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.oskvp_decode_attention import (NEG_INF, dequant_plane, fp8_rows, online_softmax_update,
                                                   split_range)


def _pick(x: jax.Array, plane: int, table: list[jax.Array]) -> jax.Array:
  """x uint8 [bs, Q]; table: 4 arrays [G, Q] -> [G, bs, Q], table[code][g, i] for each token."""
  b0 = ((x & (1 << 2 * plane)) != 0)[None]
  b1 = ((x & (2 << 2 * plane)) != 0)[None]
  t = [tc[:, None, :] for tc in table]
  return jnp.where(b1, jnp.where(b0, t[3], t[2]), jnp.where(b0, t[1], t[0]))


def lut_kernel(qp_ref, qo_ref, cbk_ref, ck_ref, ok_ref, cbv_ref, cv_ref, ov_ref, rk_ref, rv_ref, nc_ref, nr_ref,
               acc_ref, acco_ref, m_ref, l_ref, *, num_splits: int, block_s: int, block_r: int, o_dim: int):
  # qp_ref [4, G, Q] f32; qo_ref [G, OP] f32 (OP: O padded to a power of two); cbk_ref, cbv_ref [4, 4, Q] f32; ck_ref, cv_ref [S, Q] uint8;
  # ok_ref, ov_ref [S, O] fp8; rk_ref, rv_ref [R, H] bf16; nc_ref, nr_ref [] int32.
  # acc_ref [4, G, Q] f32; acco_ref [G, OP] f32; m_ref, l_ref [G] f32.
  g, q_dim = qp_ref.shape[1], qp_ref.shape[2]
  op = qo_ref.shape[1]
  split = pl.program_id(2)
  qp = [qp_ref[p] for p in range(4)]  # [G, Q] f32
  m0 = jnp.full((g,), NEG_INF, jnp.float32)
  l0 = jnp.zeros((g,), jnp.float32)
  acc0 = [jnp.zeros((g, q_dim), jnp.float32) for _ in range(4)]

  def write(acc, acco, m, l):
    for p in range(4):
      acc_ref[p] = acc[p]
    acco_ref[...] = acco
    m_ref[...] = m
    l_ref[...] = l

  @pl.when(split < num_splits)
  def _compressed():
    start, end, nblocks = split_range(nc_ref, split, num_splits, block_s)
    qo = qo_ref[...]  # [G, O]
    tables = [[qp[p] * cbk_ref[p, c][None, :] for c in range(4)] for p in range(4)]  # [G, Q] each
    cbv = [[cbv_ref[p, c][None, :] for c in range(4)] for p in range(4)]  # [1, Q] f32

    def body(i, carry):
      acc, acco, m, l = carry
      s0 = start + i * block_s
      valid = s0 + jnp.arange(block_s) < end
      rows = pl.ds(s0, block_s)
      ck = plgpu.load(ck_ref.at[rows, :], mask=valid[:, None], other=0)  # [bs, Q] uint8
      ok = fp8_rows(ok_ref, rows, valid, o_dim, op)  # [bs, OP]
      scores = (qo[:, None, :] * ok[None, :, :]).sum(axis=2)  # [G, bs]
      for p in range(4):
        scores += _pick(ck, p, tables[p]).sum(axis=2)
      pexp, alpha, m, l = online_softmax_update(scores, valid, m, l)
      cv = plgpu.load(cv_ref.at[rows, :], mask=valid[:, None], other=0).astype(jnp.int32)
      ov = fp8_rows(ov_ref, rows, valid, o_dim, op)
      acco = acco * alpha[:, None] + (pexp[:, :, None] * ov[None, :, :]).sum(axis=1)  # [G, OP]
      acc = [acc[p] * alpha[:, None] + (pexp[:, :, None] * dequant_plane(cv, p, cbv[p])[None]).sum(axis=1)
             for p in range(4)]
      return acc, acco, m, l

    acco0 = jnp.zeros((g, op), jnp.float32)
    write(*lax.fori_loop(0, nblocks, body, (acc0, acco0, m0, l0)))

  @pl.when(split == num_splits)
  def _residual():
    n = nr_ref[()]

    def body(i, carry):
      acc, m, l = carry
      r0 = i * block_r
      valid = r0 + jnp.arange(block_r) < n
      rows = pl.ds(r0, block_r)
      scores = jnp.zeros((g, block_r), jnp.float32)
      for p in range(4):
        rk = plgpu.load(rk_ref.at[rows, pl.ds(p * q_dim, q_dim)], mask=valid[:, None], other=0)
        scores += (qp[p][:, None, :] * rk.astype(jnp.float32)[None]).sum(axis=2)
      pexp, alpha, m, l = online_softmax_update(scores, valid, m, l)
      acc_new = []
      for p in range(4):
        rv = plgpu.load(rv_ref.at[rows, pl.ds(p * q_dim, q_dim)], mask=valid[:, None], other=0)
        acc_new.append(acc[p] * alpha[:, None] + (pexp[:, :, None] * rv.astype(jnp.float32)[None]).sum(axis=1))
      return acc_new, m, l

    acc, m, l = lax.fori_loop(0, pl.cdiv(n, block_r), body, (acc0, m0, l0))
    write(acc, jnp.zeros((g, op), jnp.float32), m, l)
