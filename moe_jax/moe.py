"""The MoE feed-forward layer: router, top-k selection, dropless dispatch of routed SwiGLU experts, optional shared
expert.

Shape letters: B batch, T length, D model, E experts, X experts per token, F expert hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax import experts as experts_lib
from moe_jax import routing
from moe_jax.config import ModelConfig
from moe_jax.dispatch import LocalDispatch
from moe_jax.layers import DenseMLP, normal_init


class RouterBias(nnx.Variable):
  """Selection-only bias per expert (auxiliary-loss-free balancing); not trained by gradient."""


class MoE(nnx.Module):
  """Routed experts (+ optional shared expert).

  Attributes:
    implementation: grouped-matmul implementation ("xla" or a registered kernel).
    dispatch: strategy with `LocalDispatch`'s signature (local by default; `sharding/` supplies expert-parallel).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, implementation: str = "xla", dispatch=None):
    d, e, f, dt = config.d_model, config.n_experts, config.expert_hidden, config.dtype
    self.n_experts, self.k = e, config.n_experts_per_tok
    self.router, self.norm_topk_prob = config.router, config.norm_topk_prob
    self.w_router = nnx.Param(normal_init(rngs.params(), (d, e), d, jnp.float32))  # [D, E]
    self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32))  # [E]
    self.w_gate = nnx.Param(normal_init(rngs.params(), (e, d, f), d, dt))  # [E, D, F]
    self.w_up = nnx.Param(normal_init(rngs.params(), (e, d, f), d, dt))  # [E, D, F]
    self.w_down = nnx.Param(normal_init(rngs.params(), (e, f, d), f, dt))  # [E, F, D]
    self.shared = DenseMLP(d, config.shared_expert_hidden, dtype=dt, rngs=rngs) if config.shared_expert_hidden else None
    self.w_shared_gate = (nnx.Param(normal_init(rngs.params(), (d, 1), d, dt))  # [D, 1]
                          if config.shared_expert_gate else None)
    self.implementation = implementation
    self.dispatch = dispatch or LocalDispatch()

  def expert_fn(self, x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return experts_lib.swiglu_experts(x_sorted, group_sizes, self.w_gate[...], self.w_up[...], self.w_down[...],
                                      implementation=self.implementation)

  def __call__(self, x: jax.Array, *, decoding: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x: [B, T, D] -> ([B, T, D], aux) where aux holds router statistics for the training losses. decoding: called
    by a decode step (`Block.decode`); the same computation here (routing variants such as LCVC use it)."""
    del decoding
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    logits = routing.router_logits(tokens, self.w_router[...])  # [BT, E]
    weights, ids = routing.select_experts(logits, k=self.k, router=self.router, norm_topk_prob=self.norm_topk_prob,
                                          selection_bias=self.router_bias[...])
    y = self.dispatch(tokens, weights, ids, self.expert_fn, self.n_experts)
    return self.add_shared(tokens, y).reshape(b, t, d), self.router_aux(logits, ids)

  def add_shared(self, tokens: jax.Array, y: jax.Array) -> jax.Array:
    """y + the (optionally sigmoid-gated) shared expert of tokens [T, D]; y unchanged without one."""
    if self.shared is None:
      return y
    s = self.shared(tokens)
    if self.w_shared_gate is not None:
      s = s * jax.nn.sigmoid(tokens @ self.w_shared_gate[...])
    return y + s

  def router_aux(self, logits: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
    """Router statistics for the training losses, from logits [T, E] and chosen ids [T, X]."""
    probs = routing.affinities(logits, self.router)
    if self.router == "sigmoid":  # independent gates: normalised over the experts (DeepSeek-V3's balance loss), so
      probs = probs / jnp.sum(probs, axis=-1, keepdims=True)  # the loss is 1.0 when balanced, not lowered by p -> 0
    return {
        "load_balance": routing.load_balancing_loss(probs, ids, self.n_experts),
        "z_loss": routing.z_loss(logits),
        "expert_counts": jnp.bincount(ids.reshape(-1), length=self.n_experts),
    }
