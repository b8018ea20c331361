"""Routing: router logits and top-k expert selection, as small pure functions.

Shapes: T tokens (flattened batch × length), D model dim, E experts, X experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.jit
def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """x: [T, D], w_router: [D, E] -> float32 [T, E]. Routing runs in float32 whatever the activations."""
  return jnp.einsum("TD,DE->TE", x.astype(jnp.float32), w_router.astype(jnp.float32))


def affinities(logits: jax.Array, router: str) -> jax.Array:
  """Per-expert affinity: softmax over experts (Mixtral, Qwen) or an independent sigmoid (DeepSeek-V3)."""
  if router == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if router == "sigmoid":
    return jax.nn.sigmoid(logits)
  raise ValueError(f"router={router!r} must be 'softmax' or 'sigmoid'")


@functools.partial(jax.jit, static_argnames=("k", "router", "norm_topk_prob"))
def select_experts(
    logits: jax.Array,
    *,
    k: int,
    router: str = "softmax",
    norm_topk_prob: bool = True,
    selection_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Top-k experts per token.

  Args:
    logits: float32 [T, E] router logits.
    k: X, experts per token.
    router: "softmax" or "sigmoid".
    norm_topk_prob: renormalise the chosen weights to sum to one per token.
    selection_bias: optional [E] or [T, E] added to the affinities for the choice only (the auxiliary-loss-free
      balancing bias, or a locality penalty); combine weights always come from the unbiased affinities.

  Returns:
    weights: float32 [T, X], combine weights.
    ids: int32 [T, X], chosen experts, in descending order of biased affinity.
  """
  t, e = logits.shape if logits.ndim == 2 else (None, None)
  if e is None or not 1 <= k <= e:
    raise ValueError(f"select_experts takes logits [T, E] and 1 <= k <= E, got logits {logits.shape} and k={k}")
  if selection_bias is not None and selection_bias.shape not in ((e,), (t, e)):
    raise ValueError(f"selection_bias must have shape ({e},) or ({t}, {e}), got {selection_bias.shape}")
  probs = affinities(logits, router)
  score = probs if selection_bias is None else probs + selection_bias
  _, ids = jax.lax.top_k(score, k)
  return combine_weights(probs, ids, norm_topk_prob), ids.astype(jnp.int32)


def combine_weights(probs: jax.Array, ids: jax.Array, norm_topk_prob: bool) -> jax.Array:
  """The combine weights of chosen experts: probs f32 [T, E] (`affinities`) at ids [T, X], renormalised to sum to
  one per token if `norm_topk_prob` -> f32 [T, X]."""
  weights = jnp.take_along_axis(probs, ids, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
  return weights


def load_balancing_loss(probs: jax.Array, ids: jax.Array, n_experts: int) -> jax.Array:
  """Switch-Transformer auxiliary loss E · Σ_e f_e · P_e (1.0 when perfectly balanced).

  Args:
    probs: float32 [T, E] router probabilities.
    ids: int32 [T, X] chosen experts.
  """
  counts = jnp.zeros((n_experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)
  fraction = counts / ids.size
  return n_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))


def z_loss(logits: jax.Array) -> jax.Array:
  """Router z-loss (ST-MoE): mean of logsumexp(logits)²."""
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
