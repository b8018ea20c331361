"""Wall-clock timing of jitted calls, shared by the benchmarks."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, repeats: int) -> float:
  """Median wall time of `fn()` in ms over `repeats` calls, each synced (one untimed call first: the compile)."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times) * 1e3)
