"""Greedy equality under load in bf16 (`moe_jax.serving.equality`), on the shipped tiny-trained checkpoint in bf16 on
CPU: the engine's outputs against each request decoded alone, every divergence at a near-tie, and a checker that
rejects divergences that are not.

The GPU run of the same checker (1,000 requests at concurrency 312) is benchmarks/serving_equality.py.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moe_jax import checkpoints, data
from moe_jax.serving import EngineConfig
from moe_jax.serving import equality as eq
from moe_jax.tokenizer import PAD_ID

N, CONCURRENCY, MAX_PROMPT, MAX_NEW, CACHE_LEN = 48, 16, 32, 12, 48
CONFIG = EngineConfig(num_slots=CONCURRENCY, cache_len=CACHE_LEN, kv_cache="bf16", prefill_lengths=(32,),
                      prefill_batches=(16,), max_queue=N, chunked_prefill=False)
ALONE = dict(kv_cache="bf16", cache_len=CACHE_LEN, max_new=MAX_NEW)


@pytest.fixture(scope="module")
def bf16_model():
  config, model = checkpoints.load("tiny-trained", param_dtype="bfloat16")
  assert config.dtype == jnp.bfloat16
  return model


@pytest.fixture(scope="module")
def workload():
  return eq.make_workload(N, data.load_corpus()["validation"].tokens, max_prompt=MAX_PROMPT, max_new=MAX_NEW, seed=3)


@pytest.fixture(scope="module")
def engine_run(bf16_model, workload):
  return eq.run_engine(bf16_model, workload, CONFIG)


@pytest.fixture(scope="module")
def alone(bf16_model, workload, engine_run):
  return eq.run_alone(bf16_model, workload, engine_run["tokens"], smallest_bucket=32, **ALONE)


def test_tau_bounds_one_ulp_on_every_lm_head_input():
  """The derivation of tau: moving every element of h by one bf16 ulp, with the signs that hurt most, changes the
  float32 gap l_a - l_b by at most tau."""
  rng = np.random.default_rng(0)
  d, v = 256, 64
  h = rng.normal(size=(d,)).astype(ml_dtypes.bfloat16)
  w = (rng.normal(size=(v, d)) * 0.06).astype(ml_dtypes.bfloat16)  # [V, D]
  a, b = 3, 7
  tau = float(eq._pair_tau(jnp.asarray(h), jnp.asarray(w), jnp.int32(a), jnp.int32(b)))  # pylint: disable=W0212
  diff = w[a].astype(np.float32) - w[b].astype(np.float32)
  up = np.nextafter(h, np.where(diff > 0, np.inf, -np.inf).astype(ml_dtypes.bfloat16))  # one ulp, raising the gap
  gap = lambda x: float(np.sum(x.astype(np.float32) * diff, dtype=np.float32))  # noqa: E731
  assert 0 < gap(up) - gap(h) <= tau
  assert gap(up) - gap(h) > 0.25 * tau  # and tau is not loose by orders of magnitude


def test_bf16_under_load_every_divergence_starts_at_a_near_tie(engine_run, alone, workload, bf16_model):
  report = eq.compare(workload, engine_run, alone, bf16_model, **ALONE)
  assert report["completed_once"] == N
  assert engine_run["traces_after_warmup"] == 0
  assert engine_run["max_active"] == CONCURRENCY
  assert report["exact_fraction"] >= 0.8, report
  assert report["kinds"][eq.UNEXPLAINED] == 0, [d for d in report["divergences"] if d["kind"] == eq.UNEXPLAINED]
  # The rule is selective: a position picked at random is rarely a logit near-tie.
  assert report["logit_near_tie_rate"] < 0.1
  for d in report["divergences"]:
    if d["kind"] == eq.LOGIT:
      assert d["top1_minus_top2"] <= d["top1_minus_engine"] <= d["tau"]


def test_checker_rejects_divergences_away_from_ties(engine_run, alone, workload, bf16_model):
  """A wrong token (one the model never predicts) or another request's output, put where the engine's output was,
  is reported as unexplained, router counterfactuals included."""
  picked = [i for i in range(N) if engine_run["tokens"][i] == eq.expected_tokens(
      alone[i]["tokens"], workload.stop_tokens[i]) and len(engine_run["tokens"][i]) >= 3][:3]
  assert len(picked) == 3
  bad = [list(engine_run["tokens"][i]) for i in picked]
  bad[0][0] = PAD_ID  # at the first token (produced by the prefill)
  bad[1][2] = PAD_ID  # at a later one (produced by a decode step)
  other = next(k for k in range(N) if engine_run["tokens"][k][0] != bad[2][0])
  bad[2] = list(engine_run["tokens"][other])  # a slot mix-up
  sub = eq.Workload([workload.prompts[i] for i in picked], [workload.max_tokens[i] for i in picked],
                    [() for _ in picked])
  fake = dict(engine_run, tokens=bad, ends=[1] * 3, status=["finished"] * 3)
  sub_alone = eq.run_alone(bf16_model, sub, bad, smallest_bucket=32, **ALONE)
  report = eq.compare(sub, fake, sub_alone, bf16_model, **ALONE)
  assert [d["position"] for d in report["divergences"]] == [0, 2, 0]
  assert [d["kind"] for d in report["divergences"]] == [eq.UNEXPLAINED] * 3, report["divergences"]
  assert all(not f["reproduces"] for d in report["divergences"] for f in d["router_flips"])


def test_models_the_trace_cannot_route_are_refused(tiny_model):
  """The trace writes plain `MoE` routing out; an LCVC model was traced as if unrouted (its penalty and surrogates
  ignored), so the 'alone' reference was another model."""
  from moe_jax import locality  # pylint: disable=g-import-not-at-top
  eq.check_unbiased_router(tiny_model)
  routed = locality.with_lcvc(tiny_model, locality.LCVCConfig(n_nodes=2, penalty=1.0))
  with pytest.raises(ValueError, match="block 0 is LCVC-routed"):
    eq.check_unbiased_router(routed)
