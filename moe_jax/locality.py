"""The LCVC router: locality-constrained expert choice, with low-rank surrogates for the remote experts left over.

Experts are placed on nodes in contiguous blocks (expert e on node e // (E / n_nodes)), as `sharding/` places them
when the expert axis is split over ("node", "local"); tokens by their batch row (row b of B on node b · n_nodes // B,
the batch split over nodes, so that a token's node does not depend on the sequence's length). Selection then scores
every expert by its affinity p, minus a penalty λ when the expert is on another node and p <= τ:

    score[t, e] = p[t, e] + bias[e] − λ · [node(e) != node(t)] · [p[t, e] <= τ]

The top-k of the score are chosen; the combine weights come from the unpenalised affinities (as DeepSeek-V3 does
with its balancing bias), so a remote expert that survives the penalty contributes with its true weight. τ is tuned
online toward a target remote rate with DeepSeek-V3's sign rule: τ += γ · sign(observed − target).

With `surrogates` on, a chosen remote expert is computed by its rank-r surrogate (`moe_jax/surrogates.py`), present
on every node, so that the layer needs no collective across nodes; the local experts go through the layer's dispatch
with the remote pairs' weights zeroed (an expert-parallel dispatch in node-local mode skips them entirely).

Shapes: T tokens (batch × length flattened), D model dim, E experts, X experts per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax import decode, routing
from moe_jax.dispatch import LocalDispatch
from moe_jax.moe import MoE
from moe_jax.surrogates import LowRankExperts, build_surrogates


@dataclasses.dataclass(frozen=True)
class LCVCConfig:
  """Locality-constrained routing.

  Attributes:
    n_nodes: nodes the experts (and tokens) are split over; must divide E.
    penalty: λ >= 0 subtracted from the score of a remote expert whose affinity is <= τ (0: exact routing).
    threshold: initial τ in [0, 1].
    target_remote_rate: remote fraction of chosen (token, expert) pairs that τ is tuned toward.
    threshold_step: γ > 0 of the sign update.
    surrogates: compute chosen remote experts with their low-rank surrogates (no cross-node traffic).
    surrogate_scope: "decode" uses surrogates only in single-token decode steps (`Transformer.decode` of one token;
      a prefill of any length and a multi-token extend stay exact: their all-to-all is amortised over the prompt),
      "all" in every call (e.g. to score a full causal pass as if decoded).
  """

  n_nodes: int = 2
  penalty: float = 1.0
  threshold: float = 0.5
  target_remote_rate: float = 0.1
  threshold_step: float = 0.01
  surrogates: bool = False
  surrogate_scope: str = "decode"

  def __post_init__(self):
    if self.surrogate_scope not in ("decode", "all"):
      raise ValueError(f"surrogate_scope={self.surrogate_scope!r} must be 'decode' or 'all'")
    if not isinstance(self.n_nodes, int) or self.n_nodes < 1:
      raise ValueError(f"n_nodes={self.n_nodes!r} must be a positive int")
    if not self.penalty >= 0:  # also refuses NaN; inf is a hard constraint (see lcvc_select)
      raise ValueError(f"penalty={self.penalty} must be >= 0")
    if not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"threshold={self.threshold} must be in [0, 1]")
    check_threshold_update(self.target_remote_rate, self.threshold_step, "target_remote_rate", "threshold_step")


def check_threshold_update(target: float, step: float, target_name: str = "target", step_name: str = "step") -> None:
  """Raises ValueError naming a target remote rate outside [0, 1] or a step not finite and > 0 (NaN or inf: a NaN τ
  would switch the penalty off)."""
  if not 0.0 <= target <= 1.0:
    raise ValueError(f"{target_name}={target} must be in [0, 1]")
  if not 0 < step < float("inf"):  # an infinite step makes τ NaN where the rate meets the target (inf · 0)
    raise ValueError(f"{step_name}={step} must be finite and > 0")


class LCVCThreshold(nnx.Variable):
  """τ of one layer: tuned online by `update_threshold`, not by gradient."""


class LCVCPenalty(nnx.Variable):
  """λ of one layer (a value, not a static field, so that sweeping it does not recompile)."""


def expert_nodes(n_experts: int, n_nodes: int) -> jax.Array:
  """int32 [E]: the node of each expert (contiguous blocks of E / n_nodes)."""
  if n_experts % n_nodes:
    raise ValueError(f"n_nodes={n_nodes} must divide n_experts={n_experts}")
  return jnp.arange(n_experts, dtype=jnp.int32) // (n_experts // n_nodes)


def simulated_token_nodes(batch: int, length: int, n_nodes: int) -> jax.Array:
  """int32 [B · T] (row-major): the node of each token when the B batch rows are split over nodes in contiguous
  blocks (row b on node b · n_nodes // B), as a batch-sharded mesh places them; one node per sequence, whatever T."""
  rows = (jnp.arange(batch, dtype=jnp.int32) * n_nodes) // batch
  return jnp.repeat(rows, length)


def token_nodes(dispatch, batch: int, length: int, n_nodes: int) -> jax.Array:
  """int32 [B · T]: the node of each token. An expert-parallel dispatch knows it (inside its mesh); else simulated."""
  if hasattr(dispatch, "token_nodes"):
    return dispatch.token_nodes(batch * length)
  return simulated_token_nodes(batch, length, n_nodes)


def locality_penalty(probs: jax.Array, token_node: jax.Array, expert_node: jax.Array, penalty,
                     threshold: jax.Array) -> jax.Array:
  """float32 [T, E]: −λ where the expert is remote and its affinity does not exceed τ, else 0.

  Args:
    probs: float32 [T, E] affinities.
    token_node: int32 [T]; expert_node: int32 [E].
    penalty: λ, a scalar.
    threshold: τ, a scalar.
  """
  remote = token_node[:, None] != expert_node[None, :]
  return jnp.where(remote & (probs <= threshold), -jnp.asarray(penalty, jnp.float32), 0.0)


@functools.partial(jax.jit, static_argnames=("k", "router", "norm_topk_prob"))
def lcvc_select(logits: jax.Array, *, k: int, router: str, norm_topk_prob: bool, bias: jax.Array,
                token_node: jax.Array, expert_node: jax.Array, penalty,
                threshold: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Locality-constrained top-k.

  Args:
    logits: float32 [T, E].
    bias: [E] selection-only balancing bias.
    token_node, expert_node, penalty, threshold: as `locality_penalty`.

  Returns:
    weights float32 [T, X] (from the unpenalised affinities), ids int32 [T, X], remote bool [T, X].
  """
  probs = routing.affinities(logits, router)
  # Affinities lie in [0, 1]: a λ beyond 1 + the bias's spread already ranks every penalised expert below every other
  # one, so larger λ (up to inf) are capped there, where float32 still orders the penalised experts by their scores.
  penalty = jnp.minimum(jnp.asarray(penalty, jnp.float32), 2.0 + jnp.max(bias) - jnp.min(bias))
  selection = bias[None, :] + locality_penalty(probs, token_node, expert_node, penalty, threshold)
  weights, ids = routing.select_experts(logits, k=k, router=router, norm_topk_prob=norm_topk_prob,
                                        selection_bias=selection)
  remote = expert_node[ids] != token_node[:, None]
  return weights, ids, remote


def update_threshold(threshold: jax.Array, remote_rate: jax.Array, target: float, step: float) -> jax.Array:
  """DeepSeek-V3-style sign update: raise τ (fewer exceptions) when too many pairs are remote, else lower it. A rate
  that is not finite (no token was routed) leaves τ as it was: a NaN τ would switch the penalty off for good."""
  moved = jnp.clip(threshold + step * jnp.sign(remote_rate - target), 0.0, 1.0)
  return jnp.where(jnp.isfinite(remote_rate), moved, threshold)


class LCVCMoE(MoE):
  """An MoE layer routed by LCVC; same weights and dispatch as the `MoE` it is made from.

  Attributes (besides MoE's):
    lcvc: the `LCVCConfig`.
    threshold: `LCVCThreshold` τ (scalar).
    penalty: `LCVCPenalty` λ (scalar).
    surrogate: `LowRankExperts` or None.
    use_surrogates: compute remote experts by their surrogates (static; needs `surrogate`).
  """

  def __init__(self, moe: MoE, lcvc: LCVCConfig, surrogate: LowRankExperts | None = None):  # pylint: disable=super-init-not-called
    for name, value in vars(moe).items():
      if not name.startswith("_"):
        setattr(self, name, value)
    expert_nodes(moe.n_experts, lcvc.n_nodes)  # Validates the placement.
    if lcvc.surrogates and surrogate is None:
      raise ValueError("LCVCConfig.surrogates=True needs surrogates (see moe_jax.surrogates.build_surrogates)")
    self.lcvc = lcvc
    self.threshold = LCVCThreshold(jnp.asarray(lcvc.threshold, jnp.float32))
    self.penalty = LCVCPenalty(jnp.asarray(lcvc.penalty, jnp.float32))
    self.surrogate = surrogate
    self.use_surrogates = lcvc.surrogates

  def __call__(self, x: jax.Array, *, decoding: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x: [B, T, D] -> ([B, T, D], aux) with MoE's aux plus remote_rate and surrogate_rate; decoding: called by a
    decode step (`Block.decode`), where scope "decode" uses the surrogates for one-token steps."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    logits = routing.router_logits(tokens, self.w_router[...])  # [BT, E]
    t_node = token_nodes(self.dispatch, b, t, self.lcvc.n_nodes)
    e_node = expert_nodes(self.n_experts, self.lcvc.n_nodes)
    weights, ids, remote = lcvc_select(
        logits, k=self.k, router=self.router, norm_topk_prob=self.norm_topk_prob, bias=self.router_bias[...],
        token_node=t_node, expert_node=e_node, penalty=self.penalty[...], threshold=self.threshold[...])
    surrogates = self.use_surrogates and (self.lcvc.surrogate_scope == "all" or (decoding and t == 1))
    if surrogates:
      y = self.dispatch(tokens, jnp.where(remote, 0.0, weights), ids, self.expert_fn, self.n_experts)
      y = y + LocalDispatch()(tokens, jnp.where(remote, weights, 0.0), ids, self.surrogate, self.n_experts)
    else:
      y = self.dispatch(tokens, weights, ids, self.expert_fn, self.n_experts)
    y = self.add_shared(tokens, y)
    remote_rate = jnp.mean(remote.astype(jnp.float32))
    aux = {
        **self.router_aux(logits, ids),
        "remote_rate": remote_rate,
        "surrogate_rate": remote_rate if surrogates else jnp.zeros((), jnp.float32),
    }
    return y.reshape(b, t, d), aux


def moe_layers(model) -> list[MoE]:
  """The MoE feed-forward layers of a `Transformer`, in order."""
  return [block.ffn for block in model.blocks if isinstance(block.ffn, MoE)]


def with_lcvc(model, lcvc: LCVCConfig, surrogates: list[LowRankExperts] | None = None):
  """A copy of `model` whose MoE layers route by LCVC (weights shared by value, not by reference).

  Args:
    model: a `Transformer`.
    lcvc: the routing configuration.
    surrogates: one `LowRankExperts` per MoE layer, or None.
  """
  model = nnx.clone(model)
  layers = [i for i, block in enumerate(model.blocks) if isinstance(block.ffn, MoE)]
  if surrogates is not None and len(surrogates) != len(layers):
    raise ValueError(f"got {len(surrogates)} surrogate sets for {len(layers)} MoE layers")
  for j, i in enumerate(layers):
    ffn = model.blocks[i].ffn
    if isinstance(ffn, LCVCMoE):
      raise ValueError("model already routes by LCVC")
    model.blocks[i].ffn = LCVCMoE(ffn, lcvc, None if surrogates is None else surrogates[j])
  return model


def set_penalty(model, penalty: float, threshold: float | None = None):
  """Sets λ (and optionally τ) of every LCVC layer in place; returns the model. Under jit (a traced λ or τ, e.g. a
  sweep that does not recompile) the range checks are left to the caller."""
  if not isinstance(penalty, jax.core.Tracer) and not penalty >= 0:
    raise ValueError(f"penalty={penalty} must be >= 0")
  if threshold is not None and not isinstance(threshold, jax.core.Tracer) and not 0.0 <= threshold <= 1.0:
    raise ValueError(f"threshold={threshold} must be in [0, 1]")
  for layer in moe_layers(model):
    layer.penalty[...] = jnp.asarray(penalty, jnp.float32)
    if threshold is not None:
      layer.threshold[...] = jnp.asarray(threshold, jnp.float32)
  return model


def set_surrogates(model, on: bool):
  """A copy of an LCVC model with surrogates switched on (decode) or off (prefill: remote experts exact)."""
  model = nnx.clone(model)
  for layer in moe_layers(model):
    if not isinstance(layer, LCVCMoE):
      raise ValueError("set_surrogates needs a model made by with_lcvc")
    if on and layer.surrogate is None:
      raise ValueError("this LCVC model has no surrogates")
    layer.use_surrogates = on
  return model


def routing_stats(model, tokens) -> dict[str, jax.Array]:
  """Per-MoE-layer remote and surrogate rates on a full causal pass over int tokens [B, T]: {name: float32
  [n_moe_layers]}. Tokens are checked as for `decode.logits` (an id outside the vocabulary has a NaN embedding), and
  must not be empty (the rates of no token are NaN)."""
  decode.check_logits_tokens(model.config, tokens)
  if not np.size(tokens):
    raise ValueError(f"tokens of shape {np.shape(tokens)} are empty: a routing rate needs at least one token")
  return _routing_stats(model, jnp.asarray(tokens, jnp.int32))


@jax.jit
def _routing_stats(model, tokens: jax.Array) -> dict[str, jax.Array]:
  _, auxes, _ = model.forward(tokens)
  return {name: jnp.stack([a[name] for a in auxes]) for name in ("remote_rate", "surrogate_rate")}


def tune_thresholds(model, token_batches, *, target: float | None = None, step: float | None = None) -> list[float]:
  """Tunes each LCVC layer's τ online over a stream of batches (in place). Returns the remote rate of each batch.

  Args:
    model: a model made by `with_lcvc`.
    token_batches: iterable of int32 [B, T].
    target, step: override the config's target_remote_rate and threshold_step.
  """
  check_threshold_update(0.0 if target is None else target, 1.0 if step is None else step)  # the overrides
  layers = moe_layers(model)
  history = []
  for tokens in token_batches:
    rates = routing_stats(model, tokens)["remote_rate"]
    for layer, rate in zip(layers, rates):
      tgt = layer.lcvc.target_remote_rate if target is None else target
      stp = layer.lcvc.threshold_step if step is None else step
      layer.threshold[...] = update_threshold(layer.threshold[...], rate, tgt, stp)
    history.append(float(jnp.mean(rates)))
  return history


def make_lcvc(model, lcvc: LCVCConfig, *, rank: int = 0, calibration_tokens=None):
  """Convenience: surrogates of rank `rank` (0: none; whitened when calibration tokens are given), then `with_lcvc`."""
  surrogates = build_surrogates(model, rank, calibration_tokens) if rank else None
  return with_lcvc(model, lcvc, surrogates)
