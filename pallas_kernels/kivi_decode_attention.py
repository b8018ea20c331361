"""Split-K decode attention over the KIVI 2-bit cache (`kv_cache="kivi2"`), Pallas (Triton).

The cache (`moe_jax.kv_quant.kivi`): codes_k, codes_v uint8 [B, K, S, H/4] (2-bit, planar: byte i holds channels
i, Q+i, 2Q+i, 3Q+i, Q = H/4); keys per channel in groups of 32 tokens, k_scale, k_zero f16 [B, K, S/32, H]; values
per token in groups of 32 channels, v_scale, v_zero f16 [B, K, S, H/32]; x̂ = code·scale + zero; the most recent
tokens exact in res_k, res_v bf16 [B, K, R, H]; n_comp (a multiple of 32), n_res int32 [B].

Programs (b, k, t), t < NS: a share of the compressed tokens, one key group (32 tokens) per step: each code plane
p (channels [pQ, pQ + Q)) is dequantized to bf16 in registers with its group's key scale and zero, and the
query's plane takes the dot on the tensor cores; an online softmax; the value planes (with H = 128 a plane is one
value group; with H = 64 two planes share one) dequantized with each token's scale and zero, dot with p.
Program t = NS: the residual window (exact). The NS + 1 partials merge by log-sum-exp in XLA.
The reference, `kivi_decode_attention_reference`, dequantizes in f32; the kernel differs by bf16 rounding of q,
of the dequantized tiles and of p (relative ~5e-3).

Measured on the H200 (`benchmarks/results/quantized_cache_decode.md`): correct there (relative error <= 3.5e-3),
faster than the XLA path at batch 1 from 16k tokens and at batch 8 up to 16k (16k × 8: 0.255 vs 0.294 ms), slower at
64k × 8 (0.836 vs 0.809 ms) and at batch 32, and slower than cuDNN on a bf16 cache everywhere (at most 0.5 TB/s on its
bytes; not profiled further), so `KIVIMode` keeps implementation="xla" by default. Inputs of 2^31 or more elements
are refused (`check_triton_offsets`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masked_softmax
from pallas_kernels.decode_checks import check_integer_lengths, check_kernel_args, check_triton_offsets
from pallas_kernels.oskvp_decode_attention import (MMA_ROWS, NEG_INF, default_num_splits, merge_split_partials,
                                                   online_softmax_update, run_blocks, split_range, unpack_codes,
                                                   window_attention)

GROUP = 32  # KIVI's group: tokens per key scale, channels per value scale


def dequantized_tokens(codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res,
                       dtype=jnp.float32):
  """The cache's leaves -> (k, v [B, K, S + R, H] in dtype: the dequantized store then the window, live bool
  [B, S + R]: the n_comp stored and n_res window tokens)."""
  h = res_k.shape[-1]
  s, r = codes_k.shape[2], res_k.shape[2]
  rep_t = lambda a: jnp.repeat(a.astype(dtype), GROUP, axis=-2)  # [B, K, S/32, H] -> [B, K, S, H]
  rep_c = lambda a: jnp.repeat(a.astype(dtype), h // a.shape[-1], axis=-1)  # [B, K, S, H/g] -> [B, K, S, H]
  unpack = lambda c: unpack_codes(c).astype(dtype)
  k = jnp.concatenate([unpack(codes_k) * rep_t(k_scale) + rep_t(k_zero), res_k.astype(dtype)], axis=2)
  v = jnp.concatenate([unpack(codes_v) * rep_c(v_scale) + rep_c(v_zero), res_v.astype(dtype)], axis=2)
  live = jnp.concatenate([jnp.arange(s)[None, :] < n_comp[:, None], jnp.arange(r)[None, :] < n_res[:, None]], 1)
  return k, v, live


@jax.jit
def kivi_decode_attention_reference(q, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp,
                                    n_res):
  """q [B, N, H] -> [B, N, H] (f32 dequantization and softmax over [0, n_comp) and the n_res window tokens;
  jitted)."""
  b, n, h = q.shape
  kh = codes_k.shape[1]
  k, v, live = dequantized_tokens(codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res)
  qg = q.astype(jnp.float32).reshape(b, kh, n // kh, h) * h**-0.5
  sc = jnp.einsum("BKGH,BKSH->BKGS", qg, k, precision=jax.lax.Precision.HIGHEST)
  v = jnp.where(live[:, None, :, None], v, 0.0)  # an invisible slot's value never reaches the output
  p = masked_softmax.masked_probs(sc, live[:, None, None, :])
  o = jnp.einsum("BKGS,BKSH->BKGH", p, v, precision=jax.lax.Precision.HIGHEST)
  return o.reshape(b, n, h).astype(q.dtype)


def _kernel(qp_ref, ck_ref, ks_ref, kz_ref, cv_ref, vs_ref, vz_ref, rk_ref, rv_ref, nc_ref, nr_ref, acc_ref, m_ref,
            l_ref, *, num_splits: int, block_r: int):
  # qp_ref [4, GP, Q] bf16 (q·H^-½ by plane, rows G.. zero); ck_ref, cv_ref [S, Q] uint8; ks_ref, kz_ref [S/32, H]
  # f16; vs_ref, vz_ref [S, H/32] f16; rk_ref, rv_ref [R, H] bf16; nc_ref, nr_ref [] int32.
  # acc_ref [4, GP, Q] f32; m_ref, l_ref [GP] f32.
  gp, q_dim = qp_ref.shape[1], qp_ref.shape[2]
  n_vgroups = vs_ref.shape[1]
  split = pl.program_id(2)  # read here: interpret mode cannot see program_id inside `pl.when`.
  qp = [qp_ref[p] for p in range(4)]
  state0 = ([jnp.zeros((gp, q_dim), jnp.float32) for _ in range(4)], jnp.full((gp,), NEG_INF, jnp.float32),
            jnp.zeros((gp,), jnp.float32))

  def write(acc, m, l):
    for p in range(4):
      acc_ref[p] = acc[p]
    m_ref[...] = m
    l_ref[...] = l

  @pl.when(split < num_splits)
  def _compressed():
    start, end, nblocks = split_range(nc_ref, split, num_splits, GROUP)

    def load_block(i):
      s0 = start + i * GROUP
      valid = s0 + jnp.arange(GROUP) < end
      rows = pl.ds(s0, GROUP)
      g = s0 // GROUP
      key_rows = [[plgpu.load(ref.at[g, pl.ds(p * q_dim, q_dim)]).astype(jnp.float32) for p in range(4)]
                  for ref in (ks_ref, kz_ref)]  # scale, zero: 4 planes of [Q]
      val_cols = [plgpu.load(ref.at[rows, :], mask=valid[:, None], other=0).astype(jnp.float32)
                  for ref in (vs_ref, vz_ref)]  # [32, H/32]
      ck = plgpu.load(ck_ref.at[rows, :], mask=valid[:, None], other=0).astype(jnp.int32)
      cv = plgpu.load(cv_ref.at[rows, :], mask=valid[:, None], other=0).astype(jnp.int32)
      return ck, cv, key_rows, val_cols

    def compute(i, tiles, acc, m, l):
      ck, cv, (ks, kz), (vs, vz) = tiles
      valid = start + i * GROUP + jnp.arange(GROUP) < end
      scores = jnp.zeros((gp, GROUP), jnp.float32)
      for p in range(4):
        kp = ((ck >> 2 * p) & 3).astype(jnp.float32) * ks[p][None, :] + kz[p][None, :]
        scores += plgpu.dot(qp[p], kp.astype(jnp.bfloat16), trans_b=True)
      pexp, alpha, m, l = online_softmax_update(scores, valid, m, l)
      pb = pexp.astype(jnp.bfloat16)
      new_acc = []
      for p in range(4):
        # The value group of plane p's channels [pQ, pQ + Q): p·Q // 32 (Q = 32: one group; Q = 16: two planes).
        pick = (jnp.arange(n_vgroups) == p * q_dim // GROUP)[None, :]
        s_col, z_col = [jnp.sum(jnp.where(pick, x, 0.0), axis=1)[:, None] for x in (vs, vz)]  # [32, 1]
        vp = ((cv >> 2 * p) & 3).astype(jnp.float32) * s_col + z_col
        new_acc.append(acc[p] * alpha[:, None] + plgpu.dot(pb, vp.astype(jnp.bfloat16)))
      return new_acc, m, l

    write(*run_blocks(nblocks, load_block, compute, state0, prefetch=False))

  @pl.when(split == num_splits)
  def _residual():
    write(*window_attention(nr_ref[()], block_r, [qp], rk_ref, rv_ref, *state0))


def check_inputs(q, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res) -> None:
  """Clear errors naming the argument, before anything is traced into a kernel."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
  b, n, h = q.shape
  if h not in (64, 128):
    raise ValueError(f"head dim H={h} must be 64 or 128 (a code plane must lie within one value group)")
  if codes_k.ndim != 4 or codes_k.shape[0] != b or codes_k.shape[3] != h // 4 or codes_v.shape != codes_k.shape:
    raise ValueError(f"codes_k and codes_v must be [B, K, S, H/4] = [{b}, K, S, {h // 4}], got {codes_k.shape} and "
                     f"{codes_v.shape}")
  _, kh, s, _ = codes_k.shape
  if s % GROUP:
    raise ValueError(f"capacity S={s} must be a multiple of {GROUP}")
  if k_scale.shape != (b, kh, s // GROUP, h) or k_zero.shape != k_scale.shape:
    raise ValueError(f"k_scale and k_zero must be [B, K, S/32, H] = {(b, kh, s // GROUP, h)}, got {k_scale.shape} "
                     f"and {k_zero.shape}")
  if v_scale.shape != (b, kh, s, h // min(GROUP, h)) or v_zero.shape != v_scale.shape:
    raise ValueError(f"v_scale and v_zero must be [B, K, S, H/32], got {v_scale.shape} and {v_zero.shape}")
  if res_k.ndim != 4 or res_k.shape[:2] != (b, kh) or res_k.shape[3] != h or res_v.shape != res_k.shape:
    raise ValueError(f"res_k and res_v must be [B, K, R, H], got {res_k.shape} and {res_v.shape}")
  if n % kh:
    raise ValueError(f"the {kh} kv heads must divide the {n} query heads")
  if n_comp.shape != (b,) or n_res.shape != (b,):
    raise ValueError(f"n_comp and n_res must be [B] = [{b}], got {n_comp.shape} and {n_res.shape}")
  check_integer_lengths(n_comp=n_comp, n_res=n_res)


@functools.partial(jax.jit, static_argnames=("num_splits", "interpret"))
def _pallas(q, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res, *,
            num_splits: int | None, interpret: bool):
  b, n, h = q.shape
  _, kh, s, qd = codes_k.shape
  g, r = n // kh, res_k.shape[2]
  gp = max(g, MMA_ROWS)
  ns = num_splits or default_num_splits(b, kh, s, GROUP)
  block_r = max(16, min(64, pl.next_power_of_2(r)))
  qg = (q.astype(jnp.float32) * h**-0.5).reshape(b, kh, g, 4, qd).transpose(0, 1, 3, 2, 4)  # [B, K, 4, G, Q]
  qp = jnp.pad(qg, ((0, 0),) * 3 + ((0, gp - g), (0, 0))).astype(jnp.bfloat16)
  per_head = lambda *tail: pl.BlockSpec((None, None, *tail), lambda i, j, t: (i, j) + (0,) * len(tail))
  per_prog = lambda *tail: pl.BlockSpec((None, None, None, *tail), lambda i, j, t: (i, j, t) + (0,) * len(tail))
  per_row = pl.BlockSpec((None,), lambda i, j, t: (i,))
  nv = v_scale.shape[-1]
  acc, m, l = pl.pallas_call(
      functools.partial(_kernel, num_splits=ns, block_r=block_r),
      grid=(b, kh, ns + 1),
      in_specs=[per_head(4, gp, qd), per_head(s, qd), per_head(s // GROUP, h), per_head(s // GROUP, h),
                per_head(s, qd), per_head(s, nv), per_head(s, nv), per_head(r, h), per_head(r, h), per_row, per_row],
      out_specs=[per_prog(4, gp, qd), per_prog(gp), per_prog(gp)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, ns + 1, 4, gp, qd), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, ns + 1, gp), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, ns + 1, gp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="kivi_decode",
  )(qp, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v,
    jnp.clip(n_comp, 0, s).astype(jnp.int32), jnp.clip(n_res, 0, r).astype(jnp.int32))
  acc = acc.transpose(0, 1, 2, 4, 3, 5).reshape(b, kh, ns + 1, gp, h)  # planes back to channel order
  o = merge_split_partials(acc[..., :g, :], m[..., :g], l[..., :g])  # [B, K, G, H]
  return o.reshape(b, n, h).astype(q.dtype)


def kivi_decode_attention(q, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res, *,
                          implementation: str = "pallas", num_splits: int | None = None,
                          interpret: bool = False) -> jax.Array:
  """Decode attention (one query token per sequence) over the KIVI-2 cache.

  Args:
    q: [B, N, H] (H 64 or 128; N a multiple of the K kv heads).
    codes_k, codes_v, k_scale, k_zero, v_scale, v_zero, res_k, res_v: the cache's leaves (module docstring).
    n_comp: int32 [B] compressed tokens (a multiple of 32); n_res: int32 [B] window tokens.
    implementation: "pallas" (the kernel; `interpret=True` runs it on the CPU) or "xla" (the reference).
    num_splits: programs per (row, kv head) over the compressed tokens; None picks enough to fill the GPU.

  Returns:
    [B, N, H] in q's dtype (zeros for a row with no token).
  """
  check_inputs(q, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res)
  args = (q, codes_k, k_scale, k_zero, codes_v, v_scale, v_zero, res_k, res_v, n_comp, n_res)
  if implementation == "xla":
    return kivi_decode_attention_reference(*args)
  if implementation != "pallas":
    raise ValueError(f"implementation={implementation!r} must be 'pallas' or 'xla'")
  check_kernel_args(groups=q.shape[1] // codes_k.shape[1], min_rows=MMA_ROWS, num_splits=num_splits,
                    S=codes_k.shape[2], R=res_k.shape[2])
  check_triton_offsets(codes_k=codes_k, codes_v=codes_v, k_scale=k_scale, k_zero=k_zero, v_scale=v_scale,
                       v_zero=v_zero)
  return _pallas(*args, num_splits=num_splits, interpret=interpret)
