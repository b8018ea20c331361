"""Pallas (Triton) calls lowered for an H100-class GPU on the CPU: catches Pallas-to-Triton lowering errors
(unsupported casts, shapes, primitives) in CI. Compiling that IR needs a GPU, so errors of the Triton compiler itself
are only caught by the benchmarks there."""

from unittest import mock

import jax
import pytest


def lowers_to_triton_for_hopper(fn, *args) -> bool:
  """Whether `jax.jit(fn)(*args)` lowers for CUDA with its Pallas calls as Triton custom calls (skips the test when
  jax's internals moved)."""
  try:
    from jax._src.pallas.triton import gpu_info, pallas_call_registration  # pylint: disable=g-import-not-at-top
  except ImportError:
    pytest.skip("jax internals moved")
  h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  with mock.patch.object(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return "__gpu$xla.gpu.triton" in text
