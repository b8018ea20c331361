"""Grouped-query self-attention with RoPE (and QK-norm as in Qwen3), over an explicit KV cache.

Shape letters: B batch, T length, D model, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig
from moe_jax.kv_cache import DenseKV, inference_only
from moe_jax.layers import RMSNorm, normal_init, rope


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """`jax.nn.dot_product_attention(q, k, v, is_causal=True)`, float16 included on the CPU.

  For float16, jax's XLA path asks dot_general for the `F16_F16_F32` algorithm, which the XLA CPU backend refuses at
  lowering ("not supported by dot_general on CPU"; jax's fallback only catches errors at trace time). On the CPU,
  and for float16 alone, the attention therefore runs in float32 and the result is cast back. float32 and bfloat16
  lower exactly the call they did before; float16 on other platforms lowers that call inside a `case` of constant
  index (`lax.platform_dependent`, resolved at lowering), which XLA's conditional simplifier inlines.

  Args:
    q: [B, T, N, H].
    k, v: [B, T, K, H], same dtype as q.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  if q.dtype != jnp.float16:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)

  def in_float32(q, k, v):
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    return jax.nn.dot_product_attention(*f32, is_causal=True).astype(q.dtype)

  return jax.lax.platform_dependent(q, k, v, cpu=in_float32,
                                    default=lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, n, kh, h, dt = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.dtype
    self.wq = nnx.Param(normal_init(rngs.params(), (d, n, h), d, dt))  # [D, N, H]
    self.wk = nnx.Param(normal_init(rngs.params(), (d, kh, h), d, dt))  # [D, K, H]
    self.wv = nnx.Param(normal_init(rngs.params(), (d, kh, h), d, dt))  # [D, K, H]
    self.wo = nnx.Param(normal_init(rngs.params(), (n, h, d), n * h, dt))  # [N, H, D]
    if config.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((n, h), dt))
      self.bk = nnx.Param(jnp.zeros((kh, h), dt))
      self.bv = nnx.Param(jnp.zeros((kh, h), dt))
    else:
      self.bq = self.bk = self.bv = None
    self.q_norm = RMSNorm(h, eps=config.rms_eps, dtype=dt) if config.qk_norm else None
    self.k_norm = RMSNorm(h, eps=config.rms_eps, dtype=dt) if config.qk_norm else None
    self.rope_theta = config.rope_theta

  def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [B, T, D], positions: int32 [B, T] -> q [B, T, N, H], k, v [B, T, K, H] (q and k rotated)."""
    q = jnp.einsum("BTD,DNH->BTNH", x, self.wq[...])
    k = jnp.einsum("BTD,DKH->BTKH", x, self.wk[...])
    v = jnp.einsum("BTD,DKH->BTKH", x, self.wv[...])
    if self.bq is not None:
      q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    return rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta), v

  def out(self, o: jax.Array) -> jax.Array:
    """[B, T, N, H] -> [B, T, D]."""
    return jnp.einsum("BTNH,NHD->BTD", o, self.wo[...])

  def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Causal attention over the sequence itself. Returns ([B, T, D], (k, v)) so prefill can build a cache.

    Right padding needs no extra mask: a valid query t < length only sees keys <= t, all of them valid.
    """
    q, k, v = self.qkv(x, positions)
    return self.out(causal_attention(q, k, v)), (k, v)

  def decode(self, x: jax.Array, positions: jax.Array, layer_cache):
    """x: [B, T, D] new tokens at positions [B, T] (contiguous, starting at the cached length)."""
    q, k, v = self.qkv(x, positions)
    if not isinstance(layer_cache, DenseKV):  # a compressed cache: inference-only (kv_cache.inference_only)
      q, k, v = inference_only(q), inference_only(k), inference_only(v)
    o, layer_cache = layer_cache.extend(q, k, v, positions[:, 0])
    return self.out(o), layer_cache
