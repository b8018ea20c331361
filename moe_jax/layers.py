"""Small building blocks: RMSNorm, rotary position embedding, the dense SwiGLU feed-forward.

Shape letters: see `moe_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal_init(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
  return (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale over the last axis, computed in float32."""

  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the "rotate half" layout of Hugging Face Llama/Mixtral/Qwen.

  Args:
    x: [B, T, heads, H].
    positions: int32 [B, T], the absolute position of each token.
    theta: RoPE base.

  Returns:
    [B, T, heads, H], same dtype as x; the rotation is computed in float32.
  """
  h = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : h // 2], x32[..., h // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class DenseMLP(nnx.Module):
  """SwiGLU: down(silu(x·gate) * (x·up)). Used by dense layers and the shared expert."""

  def __init__(self, d_model: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    self.w_gate = nnx.Param(normal_init(rngs.params(), (d_model, hidden), d_model, dtype))  # [D, F]
    self.w_up = nnx.Param(normal_init(rngs.params(), (d_model, hidden), d_model, dtype))  # [D, F]
    self.w_down = nnx.Param(normal_init(rngs.params(), (hidden, d_model), hidden, dtype))  # [F, D]

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., D] -> [..., D]."""
    h = jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])
    return h @ self.w_down[...]
