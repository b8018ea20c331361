"""benchmarks/float16_decode_check.py's routing trace on the CPU: flips are counted per step as sets of experts, and
rerunning the float16 model with the float32 model's choices changes nothing at steps without a flip."""

import numpy as np
import pytest

from benchmarks import float16_decode_check as bench
from moe_jax import checkpoints, routing


def test_routing_flips_compare_sets_per_layer_and_step():
  a = [np.array([[0, 1], [2, 3]]), np.array([[4, 5], [6, 7]])] * 2  # 2 layers x (prefill + 1 step)
  b = [np.array([[1, 0], [2, 3]]), np.array([[4, 5], [6, 1]]), np.array([[0, 2], [3, 2]]), np.array([[4, 5], [6, 7]])]
  assert bench.routing_flips(a, b, n_layers=2, steps=1) == [1, 1]  # order within a token's set does not count
  with pytest.raises(ValueError, match="expected 4"):
    bench.routing_flips(a[:3], b[:3], n_layers=2, steps=1)


def test_replaying_float32_routing_leaves_steps_without_flips_unchanged():
  trace = bench.RoutingTrace()
  try:
    cfg, m32 = checkpoints.load("tiny-trained")
    _, m16 = checkpoints.load("tiny-trained", param_dtype="float16")
    (row,) = bench.compare("tiny-trained", m32, m16, cfg.vocab_size, 3, 40, 64, ("fp32",), trace)
  finally:  # programs traced meanwhile keep the callback, which passes the choices through once inactive (jax's
    trace.uninstall()  # caches are not cleared: tests marked keep_jax_caches may share this worker)
  assert routing.select_experts is trace._select  # pylint: disable=protected-access
  flips, rel, replayed = row["routing_flips_by_step"], row["rel_by_step"], row["rel_by_step_float32_routing"]
  assert len(flips) == len(rel) == len(replayed) == 4 and row["finite"]
  for f, r, p in zip(flips, rel, replayed):
    if f == 0:
      assert p == pytest.approx(r, rel=1e-6, abs=1e-9)  # the same computation when the choices agree
    assert p < 0.05  # float16 with float32's routing stays near float32
