"""A watchdog for Mosaic GPU interpret-mode calls whose kernels run several warpgroups as threads.

Mosaic GPU's CPU interpreter runs each warpgroup of a CTA as its own XLA computation on a Python thread, and a
barrier wait blocks whichever XLA CPU thread runs that computation. XLA's CPU pool has one thread per core, and
sometimes a call starves: the stacks of a starved call show the pool's two threads (2 cores) blocked in barrier waits
while the other warpgroups' computations wait to start. On this 2-core machine that happened in about 1 call of 6
to 20 at 2-4 warpgroups per CTA, and on the 2-core CI it held the whole suite until the CI's limit. That is the
interpreter's scheduling, not the kernel's: a kernel whose barriers really deadlock hangs on every try.

`run_with_watchdog(fn)` (the `interpreted` fixture of tests/conftest.py) runs `fn()` in a thread. After
`timeout_s` it fails the interpreter's shared memory the way the interpreter fails a kernel that raised
(`set_failed` wakes every waiter, and the queued warpgroups stop at their first callback), resets the interpreter's
state and tries again, up to `attempts` times; then the test fails, naming both causes.
"""

import os
import threading

import jax
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
import pytest
import worker_crash_report  # pylint: disable=import-error


class InterpreterStarved(TimeoutError):
  """Raised into the interpreter's waiters when the watchdog gives up on one try."""


def run_with_watchdog(fn, *, timeout_s: float = 60.0, attempts: int = 4):
  """`jax.block_until_ready(fn())`, retried when the interpreter starves (see the module docstring)."""
  for attempt in range(1, attempts + 1):
    box = {}

    def target():
      try:
        box["out"] = jax.block_until_ready(fn())
      except Exception as e:  # pylint: disable=broad-exception-caught
        box["err"] = e

    t = threading.Thread(target=target, daemon=True, name=f"interpreted-{attempt}")
    t.start()
    t.join(timeout_s)
    if not t.is_alive():
      if "err" in box:
        raise box["err"]
      return box["out"]
    worker_crash_report.note(f"watchdog: no progress in {timeout_s} s on try {attempt} of "
                             f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}")
    try:
      gpu_callbacks._get_shared_memory().set_failed(  # pylint: disable=protected-access
          InterpreterStarved(f"no progress in {timeout_s} s (try {attempt})"), None, top_level=False)
    except AssertionError:  # the kernel finished between the join and here
      pass
    t.join(120)
    if t.is_alive():
      pytest.fail(f"the interpreter did not stop after being failed (try {attempt})")
    if "out" in box:
      return box["out"]
    gpu_callbacks.reset_gpu_interpret_mode_state()
  pytest.fail(f"the Mosaic GPU interpreter made no progress in {attempts} tries of {timeout_s} s: thread-pool "
              "starvation every time, or a real barrier deadlock in the kernel")
