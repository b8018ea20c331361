"""A watchdog for Mosaic GPU interpret-mode calls whose kernels run several warpgroups as threads.

Mosaic GPU's CPU interpreter runs each warpgroup of a CTA as its own XLA computation, and a barrier wait blocks the
XLA CPU intra-op thread that runs it. That pool has one thread per core, so on a 2-core machine a warp-specialized
kernel with 3 or 4 warpgroups can starve: two warpgroups wait on a barrier that only a third, still queued behind
them, would arrive on (seen on the 2-core CI: a hang of the whole suite; here about 1 call in 6 at 4 warpgroups).
That is the interpreter's scheduling, not the kernel's: a kernel whose barriers really deadlock hangs on every try.

`interpreted(fn)` runs `fn()` in a thread; after `timeout_s` it fails the interpreter's shared memory the way the
interpreter fails a kernel that raised (`set_failed` wakes every waiter and aborts the queued warpgroups), resets
the interpreter's state and tries again, up to `attempts` times; then the test fails, naming the starvation.
"""

import threading

import jax
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
import pytest


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


@pytest.fixture
def interpreted():
  """The watchdog as a fixture: `interpreted(lambda: kernel(..., interpret=True))`."""
  return run_with_watchdog
