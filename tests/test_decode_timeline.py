"""The timeline arithmetic of benchmarks/decode_timeline.py on hand-made events (the tracing itself needs a GPU)."""

import pytest

from benchmarks import decode_timeline as dt


def test_summarize_counts_idle_time_once_and_names_the_kernel_it_precedes():
  # Two calls: a [0, 10) then b [12, 20) (2 ns idle before b), a [20, 30) overlapped by c [25, 32), b [40, 50).
  kernels = [("Stream #1", "a", 0, 10), ("Stream #1", "b", 12, 8), ("Stream #1", "a", 20, 10),
             ("Stream #2", "c", 25, 7), ("Stream #1", "b", 40, 10)]
  host = [("python", "launch", -5, 10), ("python", "late", 60, 5), ("python", "launch", 30, 2)]
  r = dt.summarize(kernels, host, calls=2)
  us = 1e-3 / 2
  assert r["span_us"] == pytest.approx(50 * us)
  assert r["busy_us"] == pytest.approx((10 + 8 + 12 + 10) * us)  # c adds only [30, 32)
  assert r["gap_us"] == pytest.approx((2 + 8) * us)
  gaps = {g["kernel"]: g["us"] for g in r["gaps_before"]}
  assert gaps == pytest.approx({"a": 0.0, "b": 10 * us, "c": 0.0})
  own = {k["kernel"]: k["us"] for k in r["kernel_us"]}
  assert own == pytest.approx({"a": 20 * us, "b": 18 * us, "c": 7 * us})  # c's own 7 ns, though 5 overlap a
  assert {h["event"]: h["count"] for h in r["host_top"]} == {"launch": 1.0}  # "late" starts after the last kernel
  assert r["lines"] == ["Stream #1", "Stream #2"]


def test_summarize_without_gpu_events_says_so():
  assert "error" in dt.summarize([], [("python", "x", 0, 1)], calls=8)


def test_timeline_traces_the_chained_program_and_reads_the_host_planes():
  """The real path on the CPU: `chained_calls`' program runs under the JAX profiler and the trace parses (the CPU
  has no GPU stream, which the result says)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  r = dt.timeline(lambda q, x: q + x.sum(), lambda i: (jnp.ones((4, 4)), jnp.full((64, 64), float(i))), 1 << 20, 8)
  assert r["calls"] >= 8 and "no GPU events" in r["error"]
