"""benchmarks/float16_decode_check.py's routing trace on the CPU: flips are counted per step as sets of experts, a
replayed trace is what the model then routes by, and rerunning float16 with float32's choices changes nothing before
the first flip. Shapes here are used by no other test, so the decode programs compile with the trace in place."""

import numpy as np
import pytest

from benchmarks import float16_decode_check as bench
from moe_jax import checkpoints, decode, routing


def test_routing_flips_compare_sets_per_layer_and_step():
  a = [np.array([[0, 1], [2, 3]]), np.array([[4, 5], [6, 7]])] * 2  # 2 layers x (prefill + 1 step)
  b = [np.array([[1, 0], [2, 3]]), np.array([[4, 5], [6, 1]]), np.array([[0, 2], [3, 2]]), np.array([[4, 5], [6, 7]])]
  assert bench.routing_flips(a, b, n_layers=2, steps=1) == [1, 1]  # order within a token's set does not count
  with pytest.raises(ValueError, match="expected 4"):
    bench.routing_flips(a[:3], b[:3], n_layers=2, steps=1)
  with pytest.raises(ValueError, match="none recorded"):
    bench.routing_flips([], [], n_layers=2, steps=1)


def _run(model, tokens, lengths, steps):
  """Prefill (T = 37, capacity 61) and `steps` decode steps -> logits [steps + 1, B, V]."""
  logits, cache = decode.prefill(model, tokens[:, :37], lengths, kv_cache="fp32", cache_len=61, last_only=True)
  out = [np.asarray(logits)]
  for s in range(steps):
    logits, cache = decode.decode_step(model, cache, tokens[:, 37 + s])
    out.append(np.asarray(logits))
  return np.stack(out)


def test_a_replayed_trace_is_what_the_model_routes_by():
  """Replaying a run's own choices reproduces its logits exactly; replaying other experts changes them."""
  trace = bench.RoutingTrace()
  try:
    cfg, model = checkpoints.load("tiny-trained")
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, 40)).astype(np.int32)
    lengths = np.array([37, 30, 12], np.int32)
    with trace:
      own = _run(model, tokens, lengths, 2)
    calls = trace.calls
    assert len(calls) == 3 * sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    with trace.replay(calls):
      again = _run(model, tokens, lengths, 2)
    with trace.replay([(c + 1) % cfg.n_experts for c in calls]):  # every token to other experts
      other = _run(model, tokens, lengths, 2)
  finally:  # programs traced meanwhile keep the callback, which passes the choices through once inactive (jax's
    trace.uninstall()  # caches are not cleared: tests marked keep_jax_caches may share this worker)
  assert routing.select_experts is trace._select  # pylint: disable=protected-access
  np.testing.assert_array_equal(again, own)
  assert np.abs(other - own).max() > 1e-2 * np.abs(own).max()


def test_float32_routing_leaves_float16_as_it_was_before_the_first_flip():
  trace = bench.RoutingTrace()
  try:
    cfg, m32 = checkpoints.load("tiny-trained")
    _, m16 = checkpoints.load("tiny-trained", param_dtype="float16")
    (row,) = bench.compare("tiny-trained", m32, m16, cfg.vocab_size, 3, 41, 70, ("fp32",), trace)
  finally:
    trace.uninstall()
  flips, rel, replayed = row["routing_flips_by_step"], row["rel_by_step"], row["rel_by_step_float32_routing"]
  assert len(flips) == len(rel) == len(replayed) == 4 and row["finite"]
  first = next((i for i, f in enumerate(flips) if f), len(flips))
  np.testing.assert_allclose(replayed[:first], rel[:first], rtol=1e-6, atol=1e-9)  # the same computation
  assert max(replayed) < 0.05  # float16 with float32's routing stays near float32
