"""Where moe-jax's kernels run: compiled on a GPU, interpreted everywhere else.

Every "auto" implementation and every `interpret=` moe_jax passes to a Pallas kernel follows this one rule: on a GPU
backend the kernels compile (Triton or Mosaic GPU), elsewhere (the CPU tests, CI) they run in Pallas's interpreters or
the XLA reference is chosen instead. Kept here, not in `pallas_kernels/`, so that the XLA paths import no kernel.
"""

from __future__ import annotations

import jax


def on_gpu() -> bool:
  """True when JAX's default backend is a GPU: the kernels compile there."""
  return jax.default_backend() == "gpu"


def interpret_kernels() -> bool:
  """True off the GPU: a Pallas kernel called there runs in its CPU interpreter (`interpret=True`)."""
  return not on_gpu()
