"""Softmax over the visible slots only, for the decode-attention references (plain jnp).

`jax.nn.softmax` of scores masked to -inf gives NaN for a row with no visible slot (0 / 0), and `p @ V` turns a
NaN or inf value at an invisible slot into NaN (0 · NaN) although its probability is 0. The kernels never read
those slots; the references must not either:

  p = masked_probs(scores, visible)         # exactly 0 at invisible slots, a zero row where none is visible
  o = einsum(p, where(visible, values, 0))  # the caller zeroes the values at invisible slots
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_probs(scores: jax.Array, visible: jax.Array) -> jax.Array:
  """scores f32 [..., S], visible bool broadcastable to it -> softmax over the visible slots (0 elsewhere; all 0
  in a row without a visible slot)."""
  s = jnp.where(visible, scores, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(total > 0, total, 1.0)
