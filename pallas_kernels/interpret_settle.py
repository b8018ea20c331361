"""Mosaic GPU kernels in interpret mode, called from eager code, return only once the kernel has finished.

The Mosaic GPU interpreter's callbacks run JAX operations of their own (`_deallocate_barrier` indexes its allocation
key, a jax.Array), and the CPU client runs a device's computations in order. An interpreted kernel dispatched
asynchronously from eager code, followed by an eager operation on its output, can deadlock: the follow-up waits for
the kernel, and the kernel's last callback waits for its own indexing op, queued behind the follow-up. The test
suite hung that way once (`test_layer_cache_dispatches_to_the_core`: the main thread in an eager op of the window
attention, one XLA thread in `_deallocate_barrier`). Waiting on an interpreted kernel's outputs before handing them
back to eager code removes the overlap. Under jit (tracers) and on the GPU (interpret off) nothing changes.
"""

from __future__ import annotations

import functools

import jax


def settled_when_interpreted(fn):
  """Wraps a kernel entry point (jitted, `interpret` a keyword argument): `jax.block_until_ready` on its outputs
  when it ran in interpret mode outside any trace."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    out = fn(*args, **kwargs)
    if kwargs.get("interpret") and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
      jax.block_until_ready(out)
    return out

  return call
