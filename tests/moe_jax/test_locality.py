"""The LCVC router: penalty, threshold, unpenalised combine weights, online τ, and the LCVC MoE layer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import decode, locality, routing
from moe_jax.config import ModelConfig
from moe_jax.dispatch import LocalDispatch


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _logits(t=64, e=8, seed=0):
  return jax.random.normal(jax.random.key(seed), (t, e)) * 2.0


def test_placement():
  np.testing.assert_array_equal(locality.expert_nodes(8, 4), [0, 0, 1, 1, 2, 2, 3, 3])
  np.testing.assert_array_equal(locality.simulated_token_nodes(6, 1, 2), [0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(locality.simulated_token_nodes(3, 2, 2), [0, 0, 0, 0, 1, 1])  # by batch row
  np.testing.assert_array_equal(locality.simulated_token_nodes(1, 6, 2), [0] * 6)  # one sequence: one node
  with pytest.raises(ValueError, match="n_nodes=3 must divide n_experts=8"):
    locality.expert_nodes(8, 3)


@pytest.mark.parametrize("field,value", [("penalty", -1.0), ("penalty", float("nan")), ("threshold", 1.5),
                                         ("n_nodes", 0), ("threshold_step", 0.0), ("threshold_step", float("nan")),
                                         ("target_remote_rate", 2.0)])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    locality.LCVCConfig(**{field: value})


def _select(logits, penalty, threshold, n_nodes=2, k=2, router="softmax"):
  t, e = logits.shape
  return locality.lcvc_select(logits, k=k, router=router, norm_topk_prob=True, bias=jnp.zeros((e,)),
                              token_node=locality.simulated_token_nodes(t, 1, n_nodes),
                              expert_node=locality.expert_nodes(e, n_nodes), penalty=penalty,
                              threshold=jnp.float32(threshold))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_zero_penalty_is_exact_routing(router):
  logits = _logits()
  w, ids, _ = _select(logits, 0.0, 0.5, router=router)
  w_ref, ids_ref = routing.select_experts(logits, k=2, router=router)
  np.testing.assert_array_equal(ids, ids_ref)
  np.testing.assert_allclose(w, w_ref, rtol=1e-6)


def test_penalty_keeps_tokens_local_below_threshold_and_weights_unpenalised():
  logits = _logits(t=256)
  probs = jax.nn.softmax(logits, -1)
  _, _, remote_exact = _select(logits, 0.0, 1.0)
  w, ids, remote = _select(logits, 10.0, 1.0)  # τ = 1: no exception, 4 local experts >= k = 2
  assert float(remote_exact.mean()) > 0.3 and not bool(remote.any())
  chosen = jnp.take_along_axis(probs, ids, axis=1)
  np.testing.assert_allclose(w, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)  # combine: true affinities
  # A remote expert above τ survives the penalty: τ = 0.4 lets through exactly the remote experts with p > 0.4
  # that rank in the top-k among the (penalised) scores.
  _, ids_t, remote_t = _select(logits, 10.0, 0.4)
  p_remote = jnp.take_along_axis(probs, ids_t, axis=1)[remote_t]
  assert bool(remote_t.any()) and float(p_remote.min()) > 0.4


@pytest.mark.parametrize("penalty", [1e8, float("inf")])
def test_a_huge_penalty_is_a_hard_constraint_that_still_ranks_remote_experts(penalty):
  """8 nodes of 1 expert, k = 2: every token must take one remote expert, which must be its best remote one (before:
  in float32 p − 1e8 rounds to one value for every remote expert, and top-k picked by index)."""
  logits = _logits()
  probs = jax.nn.softmax(logits, -1)
  w, ids, remote = _select(logits, penalty, 1.0, n_nodes=8)
  w10, ids10, _ = _select(logits, 10.0, 1.0, n_nodes=8)  # 10 > 1 + the (zero) bias spread: already hard
  np.testing.assert_array_equal(ids, ids10)
  np.testing.assert_array_equal(w, w10)
  own = locality.simulated_token_nodes(64, 1, 8)
  best_remote = jnp.argmax(jnp.where(jnp.arange(8)[None, :] == own[:, None], -1.0, probs), -1)
  np.testing.assert_array_equal(remote.sum(-1), 1)  # its own node's expert and one remote one
  np.testing.assert_array_equal(jnp.where(remote, ids, -1).max(-1), best_remote)


def test_threshold_sign_update_moves_toward_target():
  assert float(locality.update_threshold(jnp.float32(0.5), 0.3, 0.1, 0.05)) == pytest.approx(0.55)
  assert float(locality.update_threshold(jnp.float32(0.5), 0.0, 0.1, 0.05)) == pytest.approx(0.45)
  assert float(locality.update_threshold(jnp.float32(0.99), 0.9, 0.1, 0.05)) == 1.0


def test_a_rate_that_is_not_finite_leaves_the_threshold_as_it_was():
  """Before: a NaN rate (no token routed) made τ NaN for good, and `p <= NaN` switched the penalty off."""
  for rate in (float("nan"), float("inf")):
    assert float(locality.update_threshold(jnp.float32(0.4), rate, 0.1, 0.05)) == pytest.approx(0.4)


def test_lcvc_layer_with_zero_penalty_equals_moe(tiny_model):
  moe = tiny_model.blocks[0].ffn
  x = jax.random.normal(jax.random.key(5), (4, 6, tiny_model.config.d_model))
  layer = locality.LCVCMoE(moe, locality.LCVCConfig(n_nodes=4, penalty=0.0))
  (y, aux), (y_ref, _) = jax.jit(lambda a, b, x: (a(x), b(x)))(layer, moe, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
  assert 0.5 < float(aux["remote_rate"]) < 1.0 and float(aux["surrogate_rate"]) == 0.0  # 3 of 4 nodes are remote


def test_lcvc_layer_splits_local_and_surrogate_pairs(tiny_model):
  """With surrogates the layer = exact experts on local pairs + surrogates on remote pairs (checked by hand)."""
  from moe_jax import surrogates  # pylint: disable=g-import-not-at-top
  moe = tiny_model.blocks[1].ffn
  sur = surrogates.LowRankExperts(moe.w_gate[...], moe.w_up[...], moe.w_down[...], rank=4)
  cfg = locality.LCVCConfig(n_nodes=2, penalty=0.3, threshold=0.2, surrogates=True, surrogate_scope="all")
  layer = locality.LCVCMoE(moe, cfg, sur)
  x = jax.random.normal(jax.random.key(6), (2, 8, tiny_model.config.d_model))
  y, aux = jax.jit(lambda m, x: m(x))(layer, x)
  tokens = x.reshape(16, -1)
  logits = routing.router_logits(tokens, moe.w_router[...])
  w, ids, remote = locality.lcvc_select(logits, k=moe.k, router=moe.router, norm_topk_prob=moe.norm_topk_prob,
                                        bias=moe.router_bias[...], token_node=locality.simulated_token_nodes(2, 8, 2),
                                        expert_node=locality.expert_nodes(8, 2), penalty=0.3,
                                        threshold=jnp.float32(0.2))

  @jax.jit
  def expected(moe, sur, tokens, w, ids, remote):
    return (LocalDispatch()(tokens, jnp.where(remote, 0, w), ids, moe.expert_fn, 8)
            + LocalDispatch()(tokens, jnp.where(remote, w, 0), ids, sur, 8)
            + moe.shared(tokens) * jax.nn.sigmoid(tokens @ moe.w_shared_gate[...]))

  expect = expected(moe, sur, tokens, w, ids, remote)
  np.testing.assert_allclose(y.reshape(16, -1), expect, rtol=1e-5, atol=1e-5)
  assert float(aux["surrogate_rate"]) == float(aux["remote_rate"]) == float(remote.mean()) > 0
  with pytest.raises(ValueError, match="needs surrogates"):
    locality.LCVCMoE(moe, cfg, None)
  decode_scope = dataclasses.replace(cfg, surrogate_scope="decode")
  _, aux = jax.jit(lambda m, x: m(x))(locality.LCVCMoE(moe, decode_scope, sur), x)
  assert float(aux["surrogate_rate"]) == 0.0  # scope "decode": a multi-token call keeps remote experts exact


def test_online_threshold_tuning_reduces_remote_rate(tiny_model):
  model = locality.with_lcvc(tiny_model, locality.LCVCConfig(n_nodes=2, penalty=1.0, threshold=0.0,
                                                             target_remote_rate=0.05, threshold_step=0.1))
  batches = [jax.random.randint(jax.random.key(i), (4, 32), 0, 256) for i in range(6)]
  history = locality.tune_thresholds(model, batches)
  taus = [float(layer.threshold[...]) for layer in locality.moe_layers(model)]
  assert history[0] > 0.3  # τ = 0: every remote expert is an exception, as with exact routing
  assert history[-1] < history[0] / 2 and all(t > 0 for t in taus)
  assert not any(isinstance(b.ffn, locality.LCVCMoE) for b in tiny_model.blocks)


_TOY = ModelConfig(vocab_size=19, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, n_experts=4,
                   n_experts_per_tok=2, expert_hidden=6, max_seq_len=16)


@pytest.mark.parametrize("batch", [1, 3])
def test_lcvc_token_nodes_follow_the_batch_row_so_decoding_equals_the_full_pass(batch):
  """Batch 1 and 3 over 2 nodes, remote experts exact: a prefix's logits are the full pass's, and prefill + decode
  steps give the full pass's logits to 1e-5 (before: tokens were placed by position within the flattened batch, so
  one sequence straddled the nodes and a decode step put every token on node 0: errors 0.17-1.5)."""
  model = locality.make_lcvc(decode.init_model(_TOY, seed=0),
                             locality.LCVCConfig(n_nodes=2, penalty=1.0, threshold=0.5))
  toks = np.random.default_rng(1).integers(0, 19, size=(batch, 6)).astype(np.int32)
  full = np.asarray(decode.logits(model, toks))
  np.testing.assert_allclose(np.asarray(decode.logits(model, toks[:, :3])), full[:, :3], atol=1e-5)
  _, cache = decode.prefill(model, toks[:, :3], np.full((batch,), 3, np.int32), kv_cache="fp32", cache_len=8)
  for s in range(3, 6):
    step, cache = decode.decode_step(model, cache, toks[:, s])
    np.testing.assert_allclose(np.asarray(step), full[:, s], atol=1e-5)


def test_surrogate_scope_decode_keeps_a_one_token_prefill_exact():
  """Scope "decode": a prefill of one-token prompts is exact (before: decided by T == 1, so it went through the
  surrogates, 0.54 off); its decode steps use the surrogates (they differ from the exact model's)."""
  sur = locality.make_lcvc(decode.init_model(_TOY, seed=0),
                           locality.LCVCConfig(n_nodes=2, penalty=0.0, surrogates=True), rank=1)
  exact = locality.set_surrogates(sur, False)  # the same routing, remote experts exact
  toks, lengths = np.array([[3], [5]], np.int32), np.array([1, 1], np.int32)
  (a, ca), (b, cb) = (decode.prefill(m, toks, lengths, kv_cache="fp32", cache_len=8) for m in (sur, exact))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  step_a, _ = decode.decode_step(sur, ca, np.array([7, 2], np.int32))
  step_b, _ = decode.decode_step(exact, cb, np.array([7, 2], np.int32))
  assert float(np.abs(np.asarray(step_a) - np.asarray(step_b)).max()) > 1e-3


def test_tune_thresholds_refuses_a_nan_or_infinite_step():
  """An infinite γ made τ NaN where the rate met the target (inf · sign(0)), switching the penalty off silently."""
  model = locality.make_lcvc(decode.init_model(_TOY, seed=0), locality.LCVCConfig(n_nodes=2))
  for step in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match=f"step={step} must be finite and > 0"):
      locality.tune_thresholds(model, [np.zeros((2, 4), np.int32)], step=step)
  with pytest.raises(ValueError, match="threshold_step=inf must be finite and > 0"):
    locality.LCVCConfig(n_nodes=2, threshold_step=float("inf"))


def test_routing_stats_and_tuning_refuse_ids_outside_the_vocabulary():
  """Before: an id past the vocabulary gave NaN activations, a remote rate of 0.5 and a τ moved on it, silently."""
  model = locality.make_lcvc(decode.init_model(_TOY, seed=0), locality.LCVCConfig(n_nodes=2))
  before = [float(layer.threshold[...]) for layer in locality.moe_layers(model)]
  bad = np.zeros((2, 4), np.int32)
  bad[1, 2] = _TOY.vocab_size + 5
  with pytest.raises(ValueError, match=rf"token id {_TOY.vocab_size + 5} at tokens\[1, 2\] is outside"):
    locality.routing_stats(model, bad)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    locality.tune_thresholds(model, [bad])
  assert [float(layer.threshold[...]) for layer in locality.moe_layers(model)] == before  # τ untouched
  with pytest.raises(ValueError, match=r"tokens must be an integer array \[batch, length\]"):
    locality.routing_stats(model, np.zeros((4,), np.int32))


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_routing_stats_and_tuning_refuse_an_empty_batch(shape):
  """Before: an empty batch had a NaN remote rate, which made τ NaN and routing exact from then on."""
  model = locality.make_lcvc(decode.init_model(_TOY, seed=0), locality.LCVCConfig(n_nodes=2))
  before = [float(layer.threshold[...]) for layer in locality.moe_layers(model)]
  tokens = np.zeros((2, 4), np.int32)
  with pytest.raises(ValueError, match=rf"tokens of shape \({shape[0]}, {shape[1]}\) are empty"):
    locality.tune_thresholds(model, [tokens, np.zeros(shape, np.int32), tokens])
  assert [float(layer.threshold[...]) for layer in locality.moe_layers(model)] != before  # the first batch ran
  assert all(np.isfinite(float(layer.threshold[...])) for layer in locality.moe_layers(model))


def test_set_penalty_takes_a_traced_value_under_jit(tiny_model):
  """A λ sweep under nnx.jit (LCVCPenalty is a value so that it does not recompile): the range check needed a
  concrete λ and raised TracerBoolConversionError."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = locality.with_lcvc(tiny_model, locality.LCVCConfig(n_nodes=2, penalty=0.0))

  @nnx.jit
  def set_and_read(model, lam):
    locality.set_penalty(model, lam)
    return model.blocks[0].ffn.penalty[...]

  assert float(set_and_read(model, jnp.float32(0.25))) == 0.25
  assert float(model.blocks[0].ffn.penalty[...]) == 0.25  # the update reached the model
  with pytest.raises(ValueError, match="penalty=-1.0 must be >= 0"):
    locality.set_penalty(model, -1.0)
