"""Keeps each test process's memory mappings under the kernel's limit per process (`vm.max_map_count`).

XLA:CPU maps every executable it loads into the process (code, read-only data and data: three anonymous mappings for
a small program), and jax keeps every executable in its caches for the life of the process. A pytest worker compiles
tens of thousands of small programs over the suite (eager ops at new shapes, interpret-mode kernels), so its
mappings only grow. On 2026-12-06 a worker reached 63,636 mappings against the limit of 65,530 and segfaulted in its
next compile: a failed `mmap` inside XLA. That was the cause of the workers' crashes at scattered tests
(tests/README.md); the other worker of that run stood at 37,000.

`release_if_over` (called after every test by tests/conftest.py) clears jax's caches once the process holds more than
`fraction` of the limit (and `margin` of it more than the last clear left); `jax.clear_caches` drops the executables
and their mappings go with them. Programs a later test needs compile again, or come back from the persistent
compilation cache.
"""

from __future__ import annotations

import gc

import jax

_DEFAULT_LIMIT = 65530  # Linux's default vm.max_map_count


def map_limit() -> int:
  """The kernel's limit on one process's memory mappings (`/proc/sys/vm/max_map_count`)."""
  try:
    with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
      return int(f.read())
  except (OSError, ValueError):
    return _DEFAULT_LIMIT


def mapping_count() -> int:
  """This process's memory mappings (lines of `/proc/self/maps`); 0 where /proc is missing."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


_floor = 0  # mappings left after the last clear: what clearing cannot take back


def release_if_over(fraction: float = 0.5, margin: float = 0.1, cap: float = 0.9) -> tuple[int, int] | None:
  """Clears jax's caches if this process holds more than `fraction` of `map_limit()` mappings, and more than
  `margin` of it above what the last clear left. The second bound is the hysteresis: where a clear leaves more than
  the threshold (mappings that are not jax's executables), the next test would otherwise clear again, and every test
  after it would recompile what it needs. That bound never rises above `cap` of the limit, so a clear that leaves the
  count near the limit does not switch clearing off.

  Returns:
    (mappings before, mappings after) when it cleared, else None.
  """
  global _floor  # pylint: disable=global-statement
  limit, before = map_limit(), mapping_count()
  if before <= max(fraction * limit, min(_floor + margin * limit, cap * limit)):
    return None
  jax.clear_caches()
  gc.collect()
  _floor = mapping_count()
  return before, _floor


def reset() -> None:
  """Forgets the last clear's floor (for tests of this module)."""
  global _floor  # pylint: disable=global-statement
  _floor = 0
