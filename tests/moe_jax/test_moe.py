"""Routing and dispatch: every dispatch variant against a deliberately slow loop-over-experts reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import dispatch, routing
from moe_jax.moe import MoE


def slow_moe_reference(layer: MoE, x: np.ndarray) -> np.ndarray:
  """Per token, per chosen expert, in float64 numpy: the definition of the MoE layer."""
  w_router = np.asarray(layer.w_router[...], np.float64)
  gate, up, down = (np.asarray(w[...], np.float64) for w in (layer.w_gate, layer.w_up, layer.w_down))
  bias = np.asarray(layer.router_bias[...], np.float64)
  out = np.zeros(x.shape, np.float64)
  silu = lambda z: z / (1 + np.exp(-z))
  for t, tok in enumerate(np.asarray(x, np.float64)):
    logits = tok @ w_router
    if layer.router == "softmax":
      probs = np.exp(logits - logits.max())
      probs /= probs.sum()
    else:
      probs = 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-(probs + bias), kind="stable")[: layer.k]
    weights = probs[chosen]
    if layer.norm_topk_prob:
      weights = weights / weights.sum()
    for e, w in zip(chosen, weights):
      out[t] += w * ((silu(tok @ gate[e]) * (tok @ up[e])) @ down[e])
    if layer.shared is not None:
      s = (silu(tok @ np.asarray(layer.shared.w_gate[...])) * (tok @ np.asarray(layer.shared.w_up[...])))
      s = s @ np.asarray(layer.shared.w_down[...])
      if layer.w_shared_gate is not None:
        s = s / (1 + np.exp(-(tok @ np.asarray(layer.w_shared_gate[...]))))
      out[t] += s
  return out


@pytest.mark.parametrize("router, norm, shared", [("softmax", True, 64), ("softmax", False, 0),
                                                  ("sigmoid", True, 0)])
def test_moe_matches_slow_reference(tiny_config, router, norm, shared):
  config = tiny_config.replace(router=router, norm_topk_prob=norm, shared_expert_hidden=shared,
                               shared_expert_gate=bool(shared))
  seed = {"softmax": 0, "sigmoid": 1}[router] + 2 * norm + 4 * bool(shared)  # fixed per case, order-independent
  layer = MoE(config, rngs=nnx.Rngs(seed))
  layer.router_bias[...] = jax.random.normal(jax.random.key(3), layer.router_bias.shape) * 0.05
  x = jax.random.normal(jax.random.key(100 + seed), (3, 7, config.d_model))
  y, aux = layer(x)
  ref = slow_moe_reference(layer, np.asarray(x).reshape(-1, config.d_model)).reshape(x.shape)
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)
  assert int(aux["expert_counts"].sum()) == 3 * 7 * config.n_experts_per_tok


def test_permute_unpermute_roundtrip():
  t, k, e, d = 13, 3, 5, 4
  ids = jax.random.randint(jax.random.key(0), (t, k), 0, e)
  x = jax.random.normal(jax.random.key(1), (t, d))
  x_sorted, sizes, order = dispatch.permute(x, ids, e)
  assert np.all(np.diff(np.asarray(ids).reshape(-1)[np.asarray(order)]) >= 0), "rows not grouped by expert"
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(np.asarray(ids).reshape(-1), minlength=e))
  back = dispatch.unpermute(x_sorted, order, t, k)
  np.testing.assert_array_equal(np.asarray(back), np.repeat(np.asarray(x)[:, None], k, axis=1))


def test_local_dispatch_with_empty_experts():
  """All tokens to two of eight experts: six empty groups must not disturb ragged_dot."""
  t, d, e = 9, 6, 8
  x = jax.random.normal(jax.random.key(2), (t, d))
  ids = jnp.stack([jnp.full((t,), 3), jnp.full((t,), 6)], axis=1).astype(jnp.int32)
  weights = jnp.full((t, 2), 0.5)
  w = jax.random.normal(jax.random.key(4), (e, d, d))
  fn = lambda xs, sizes: jax.lax.ragged_dot(xs, w, sizes)
  y = dispatch.LocalDispatch()(x, weights, ids, fn, e)
  np.testing.assert_allclose(np.asarray(y), np.asarray(0.5 * (x @ w[3] + x @ w[6])), rtol=1e-5, atol=1e-5)


def test_select_experts_properties():
  logits = jax.random.normal(jax.random.key(5), (50, 16))
  w, ids = routing.select_experts(logits, k=4, router="softmax", norm_topk_prob=True)
  np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
  probs = np.asarray(jax.nn.softmax(logits))
  np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(np.argsort(-probs, -1)[:, :4], -1))
  # A selection bias changes the choice but never the weights' source: weights are the unbiased affinities.
  bias = jnp.zeros(16).at[0].set(10.0)
  w2, ids2 = routing.select_experts(logits, k=4, router="sigmoid", norm_topk_prob=False, selection_bias=bias)
  assert np.all(np.asarray(ids2)[:, 0] == 0)
  np.testing.assert_allclose(np.asarray(w2), np.take_along_axis(np.asarray(jax.nn.sigmoid(logits)),
                                                                 np.asarray(ids2), -1), rtol=1e-6)


def test_select_experts_names_bad_k_logits_and_bias():
  logits = jnp.zeros((5, 8))
  for k in (9, 0):  # before: lax.top_k's error for 9, an empty [T, 0] result for 0
    with pytest.raises(ValueError, match=rf"1 <= k <= E, got logits \(5, 8\) and k={k}"):
      routing.select_experts(logits, k=k)
  with pytest.raises(ValueError, match=r"logits \[T, E\]"):  # before: ran on a 1-D row
    routing.select_experts(logits[0], k=2)
  with pytest.raises(ValueError, match=r"selection_bias must have shape \(8,\) or \(5, 8\), got \(7,\)"):
    routing.select_experts(logits, k=2, selection_bias=jnp.zeros(7))
  with pytest.raises(ValueError, match="router='nope'"):
    routing.select_experts(logits, k=2, router="nope")


def test_load_balancing_loss_is_one_when_balanced():
  e = 4
  ids = jnp.arange(8).reshape(8, 1) % e
  probs = jnp.full((8, e), 1 / e)
  assert abs(float(routing.load_balancing_loss(probs, ids, e)) - 1.0) < 1e-6


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_layer_balance_loss_is_one_when_balanced_for_both_routers(tiny_config, router):
  """Equal affinities, every expert chosen equally often: the layer's load_balance is 1.0 for either router, and a
  uniform shift of the logits (all sigmoid gates toward 0) does not lower it (before: the sigmoid router's raw gates
  gave E/2 = 4.0, and pushing every logit down lowered the loss without balancing anything)."""
  moe = MoE(tiny_config.replace(router=router), rngs=nnx.Rngs(0))
  e = moe.n_experts
  ids = (jnp.arange(4 * e).reshape(2 * e, 2) % e).astype(jnp.int32)
  for shift in (0.0, -5.0):
    aux = moe.router_aux(jnp.full((2 * e, e), shift, jnp.float32), ids)
    assert abs(float(aux["load_balance"]) - 1.0) < 1e-5, (router, shift, float(aux["load_balance"]))
