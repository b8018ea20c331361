"""The GPU kernels a call launches, timed by CUPTI (through Mosaic GPU's profiler extension): shared by the
benchmarks that break a step or a fit down by kernel (`e2e_step_profile.py`, `oskvp_refit_parts.py --kernels`) and
those that time a call's kernels alone (`cupti_median_ms`)."""

from __future__ import annotations

import collections
import re
import statistics

import jax


def kernel_group(name: str) -> str:
  """A kernel's group: its name without XLA's numeric suffixes (fusion_12 -> fusion), Triton/Pallas names kept."""
  return re.sub(r"(_\d+)+$", "", name.split("(")[0])[:80]


def cupti_kernels(call):
  """(call()'s outputs, [(kernel name, ms)] of the kernels it launched), by CUPTI.

  `jax.experimental.mosaic.gpu.profiler.measure` runs its function twice on the same arguments (a warm-up, then
  the measured call), which a step that donates its cache cannot do; this is its measured half, with the same
  extension calls, around one call of an already compiled step.
  """
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # pylint: disable=g-import-not-at-top
  if mosaic_gpu_lib is None:
    raise RuntimeError("CUPTI profiling is not supported on this platform")
  ext = mosaic_gpu_lib._mosaic_gpu_ext  # pylint: disable=protected-access
  ext._cupti_init()  # pylint: disable=protected-access
  try:
    out = jax.block_until_ready(call())
  finally:
    timings = ext._cupti_get_timings(True)  # pylint: disable=protected-access
  return out, timings or []


def cupti_median_ms(call, iters: int) -> tuple[float, int]:
  """(median over iters calls of the summed CUPTI time of the kernels one call launches, in ms; the kernels per
  call), after one warm-up call."""
  jax.block_until_ready(call())
  runs = [cupti_kernels(call)[1] for _ in range(iters)]
  return statistics.median(sum(ms for _, ms in timings) for timings in runs), len(runs[-1])


def kernel_table(timings: list[tuple[str, float]], top: int | None = 15) -> list[dict]:
  """[(kernel name, ms)] -> the `top` (None: all) kernel groups (`kernel_group`) by summed ms, longest first:
  [{kernel, count, ms}]."""
  groups = collections.defaultdict(lambda: [0, 0.0])
  for name, ms in timings:
    g = groups[kernel_group(name)]
    g[0] += 1
    g[1] += ms
  rows = [{"kernel": k, "count": c, "ms": t} for k, (c, t) in groups.items()]
  return sorted(rows, key=lambda r: -r["ms"])[:top]  # [:None]: all
