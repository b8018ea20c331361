"""Split-K decode attention over a per-token 8-bit KV cache (`kv_cache="fp8"` / `"int8"`), Pallas (Triton).

The cache stores each token and kv head as H values in float8_e4m3fn or int8 and one f32 scale (x ≈ value · scale,
`moe_jax.kv_quant.per_token`): k, v [B, S, K, H], k_scale, v_scale [B, S, K]. One program per (row b, kv head k,
split t) streams `block_s` tokens at a time of its share of [0, lengths[b]):
  scores [GP, bs] = (q·H^-½ in bf16) @ k_tileᵀ (8-bit -> bf16 exactly) on the tensor cores, times the keys' scales;
  an online softmax (f32 m, l per query head);
  acc [GP, H] += (p · v_scale) in bf16 @ v_tile.
The G query heads of kv head k fill GP = max(G, 16) rows (a Triton dot needs 16). The splits' partials merge by
log-sum-exp in XLA (`oskvp_decode_attention.merge_split_partials`). The reference,
`per_token_decode_attention_reference`, dequantizes in f32 and runs the dense softmax; the kernel differs from it by
the bf16 rounding of q and of p·v_scale (relative ~4e-3).

Measured on the H200 (`benchmarks/results/quantized_cache_decode.md`): correct there (relative error 4-5e-3 vs
the reference), but slower than the XLA path at every grid point, e.g. 64k × batch 8 fp8 0.670 ms vs XLA 0.444 ms
and cuDNN on bf16 0.526 ms (42% vs 66% of copy bandwidth), so `PerTokenMode` keeps implementation="xla" by default.
Inputs of 2^31 or more elements are refused (`check_triton_offsets`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import masked_softmax
from pallas_kernels.decode_checks import check_integer_lengths, check_kernel_args, check_triton_offsets
from pallas_kernels.oskvp_decode_attention import (MMA_ROWS, NEG_INF, default_num_splits, fp8_rows,
                                                   merge_split_partials, online_softmax_update, run_blocks,
                                                   split_range)

DTYPES = ("float8_e4m3fn", "int8")


@jax.jit
def per_token_decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, k_scale: jax.Array,
                                         v_scale: jax.Array, lengths: jax.Array) -> jax.Array:
  """q [B, N, H]; k, v [B, S, K, H] 8-bit; k_scale, v_scale f32 [B, S, K]; lengths int32 [B] (keys s < lengths[b]
  are visible) -> [B, N, H] in q's dtype (f32 dequantization and softmax; jitted)."""
  b, n, h = q.shape
  kh = k.shape[2]
  kf = k.astype(jnp.float32) * k_scale[..., None]
  vf = v.astype(jnp.float32) * v_scale[..., None]
  qg = q.astype(jnp.float32).reshape(b, kh, n // kh, h) * h**-0.5
  s = jnp.einsum("BKGH,BSKH->BKGS", qg, kf, precision=jax.lax.Precision.HIGHEST)
  visible = jnp.arange(k.shape[1]) < lengths[:, None]  # [B, S]
  vf = jnp.where(visible[:, :, None, None], vf, 0.0)  # an invisible slot's value never reaches the output
  p = masked_softmax.masked_probs(s, visible[:, None, None, :])
  o = jnp.einsum("BKGS,BSKH->BKGH", p, vf, precision=jax.lax.Precision.HIGHEST)
  return o.reshape(b, n, h).astype(q.dtype)


def _kernel(q_ref, k_ref, v_ref, ks_ref, vs_ref, n_ref, acc_ref, m_ref, l_ref, *, num_splits: int, block_s: int):
  # q_ref [GP, H] bf16 (scaled by H^-½, rows G.. zero); k_ref, v_ref [S, H] 8-bit; ks_ref, vs_ref [S] f32;
  # n_ref [] int32. acc_ref [GP, H] f32; m_ref, l_ref [GP] f32.
  gp, h = q_ref.shape
  start, end, nblocks = split_range(n_ref, pl.program_id(2), num_splits, block_s)
  q = q_ref[...]

  def load_block(i):
    s0 = start + i * block_s
    valid = s0 + jnp.arange(block_s) < end
    rows = pl.ds(s0, block_s)
    scales = [plgpu.load(ref.at[rows], mask=valid, other=0.0) for ref in (ks_ref, vs_ref)]
    return (fp8_rows(k_ref, rows, valid, h, h, dtype=jnp.bfloat16), fp8_rows(v_ref, rows, valid, h, h,
                                                                             dtype=jnp.bfloat16), *scales)

  def compute(i, tiles, acc, m, l):
    k, v, ks, vs = tiles
    valid = start + i * block_s + jnp.arange(block_s) < end
    scores = plgpu.dot(q, k, trans_b=True) * ks[None, :]  # [GP, bs] f32
    p, alpha, m, l = online_softmax_update(scores, valid, m, l)
    acc = acc * alpha[:, None] + plgpu.dot((p * vs[None, :]).astype(jnp.bfloat16), v)
    return acc, m, l

  state0 = (jnp.zeros((gp, h), jnp.float32), jnp.full((gp,), NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32))
  acc, m, l = run_blocks(nblocks, load_block, compute, state0, prefetch=False)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def check_inputs(q, k, v, k_scale, v_scale, lengths) -> None:
  """Clear errors naming the argument, before anything is traced into a kernel."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
  b, n, h = q.shape
  if k.ndim != 4 or k.shape[0] != b or k.shape[3] != h or v.shape != k.shape:
    raise ValueError(f"k and v must be [B, S, K, H] = [{b}, S, K, {h}], got {k.shape} and {v.shape}")
  if str(k.dtype) not in DTYPES or v.dtype != k.dtype:
    raise ValueError(f"k, v dtype must be one of {DTYPES} (both the same), got {k.dtype} and {v.dtype}")
  if k_scale.shape != k.shape[:3] or v_scale.shape != k.shape[:3]:
    raise ValueError(f"k_scale and v_scale must be [B, S, K] = {k.shape[:3]}, got {k_scale.shape} and "
                     f"{v_scale.shape}")
  if n % k.shape[2]:
    raise ValueError(f"the {k.shape[2]} kv heads must divide the {n} query heads")
  if h % 16 or h & (h - 1):
    raise ValueError(f"head dim H={h} must be a power of two >= 16 (Triton tiles)")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B] = [{b}], got {lengths.shape}")
  check_integer_lengths(lengths=lengths)


@functools.partial(jax.jit, static_argnames=("block_s", "num_splits", "num_warps", "num_stages", "interpret"))
def _pallas(q, k, v, k_scale, v_scale, lengths, *, block_s: int, num_splits: int | None, num_warps: int,
            num_stages: int, interpret: bool):
  b, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  gp = max(g, MMA_ROWS)
  ns = num_splits or default_num_splits(b, kh, s, block_s)
  qg = (q.astype(jnp.float32) * h**-0.5).reshape(b, kh, g, h)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0))).astype(jnp.bfloat16)
  per_head = lambda *tail: pl.BlockSpec((None, None, *tail), lambda i, j, t: (i, j) + (0,) * len(tail))
  per_prog = lambda *tail: pl.BlockSpec((None, None, None, *tail), lambda i, j, t: (i, j, t) + (0,) * len(tail))
  tokens = lambda *tail: pl.BlockSpec((None, s, None, *tail), lambda i, j, t: (i, 0, j) + (0,) * len(tail))
  acc, m, l = pl.pallas_call(
      functools.partial(_kernel, num_splits=ns, block_s=block_s),
      grid=(b, kh, ns),
      in_specs=[per_head(gp, h), tokens(h), tokens(h), tokens(), tokens(),
                pl.BlockSpec((None,), lambda i, j, t: (i,))],
      out_specs=[per_prog(gp, h), per_prog(gp), per_prog(gp)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, ns, gp, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, ns, gp), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, ns, gp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="per_token_decode",
  )(qg, k, v, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), jnp.clip(lengths, 0, s).astype(jnp.int32))
  o = merge_split_partials(acc[..., :g, :], m[..., :g], l[..., :g])  # [B, K, G, H]
  return o.reshape(b, n, h).astype(q.dtype)


def per_token_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_scale: jax.Array, v_scale: jax.Array,
                               lengths: jax.Array, *, implementation: str = "pallas", block_s: int = 64,
                               num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                               interpret: bool = False) -> jax.Array:
  """Decode attention (one query token per sequence) over a per-token 8-bit cache.

  Args:
    q: [B, N, H] (N a multiple of the K kv heads).
    k, v: [B, S, K, H] float8_e4m3fn or int8 (the cache's own layout).
    k_scale, v_scale: f32 [B, S, K], one scale per token and kv head.
    lengths: int32 [B], keys s < lengths[b] are visible (0 gives zeros; lengths past S see the whole cache).
    implementation: "pallas" (the kernel; `interpret=True` runs it on the CPU) or "xla" (the reference).
    block_s: tokens per loop step (a power of two >= 16).
    num_splits: programs per (row, kv head) along the sequence; None picks enough to fill the GPU.
    num_warps, num_stages: Triton's (guesses until measured; `benchmarks/quantized_cache_decode.py` sweeps them).

  Returns:
    [B, N, H] in q's dtype.
  """
  check_inputs(q, k, v, k_scale, v_scale, lengths)
  if implementation == "xla":
    return per_token_decode_attention_reference(q, k, v, k_scale, v_scale, lengths)
  if implementation != "pallas":
    raise ValueError(f"implementation={implementation!r} must be 'pallas' or 'xla'")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"block_s={block_s} must be a power of two >= 16")
  check_kernel_args(groups=q.shape[1] // k.shape[2], min_rows=MMA_ROWS, num_splits=num_splits, S=k.shape[1])
  check_triton_offsets(k=k, v=v)
  return _pallas(q, k, v, k_scale, v_scale, lengths, block_s=block_s, num_splits=num_splits, num_warps=num_warps,
                 num_stages=num_stages, interpret=interpret)
