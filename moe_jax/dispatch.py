"""Dropless token dispatch on one device: sort token-expert pairs by expert, run the experts, unsort, combine.

`LocalDispatch` is the MoE layer's default strategy; `sharding/expert_parallel.py` supplies the expert-parallel one
with the same call signature.

Shapes: T tokens, D model dim, E experts, X experts per token, M = T·X token-expert pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# expert_fn(x_sorted [M, D], group_sizes int32 [E]) -> [M, D]
ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]


def permute(x: jax.Array, ids: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Groups the token-expert pairs by expert.

  Args:
    x: [T, D] tokens.
    ids: int32 [T, X] chosen experts.
    n_experts: E.

  Returns:
    x_sorted: [M, D], row m is token order[m] // X, sorted by expert id (stable).
    group_sizes: int32 [E], rows per expert.
    order: int32 [M], the flat pair index of each sorted row.
  """
  flat = ids.reshape(-1)  # [M]
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  x_sorted = jnp.take(x, order // ids.shape[1], axis=0)
  group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
  return x_sorted, group_sizes, order


def unpermute(y_sorted: jax.Array, order: jax.Array, n_tokens: int, k: int) -> jax.Array:
  """Inverse of `permute`: [M, D] sorted rows -> [T, X, D] in token order."""
  y = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
  return y.reshape(n_tokens, k, y_sorted.shape[-1])


def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
  """[T, X, D] expert outputs weighted by [T, X] -> [T, D], accumulated in float32."""
  return jnp.einsum("TXD,TX->TD", y.astype(jnp.float32), weights.astype(jnp.float32)).astype(y.dtype)


@dataclasses.dataclass(frozen=True)
class LocalDispatch:
  """All experts on this device: permute -> expert_fn -> unpermute -> combine."""

  def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array, expert_fn: ExpertFn,
               n_experts: int) -> jax.Array:
    """x: [T, D], weights: [T, X], ids: [T, X] -> [T, D]."""
    x_sorted, group_sizes, order = permute(x, ids, n_experts)
    y_sorted = expert_fn(x_sorted, group_sizes)
    return combine(unpermute(y_sorted, order, x.shape[0], ids.shape[1]), weights)
