"""Whether a device runs this project's Mosaic GPU kernels: they issue Hopper's wgmma and setmaxnreg (sm_90a).

The Mosaic GPU kernels (`int4_grouped_matmul_mgpu*.py`, `oskvp_decode_core_mgpu.py` and their building blocks) run
on the CPU in Mosaic GPU's interpreter and on NVIDIA GPUs of compute capability 9.x only; on another GPU their
compilation fails deep inside Mosaic. Callers pick another kernel there (`mosaic_gpu_runs`) or raise a clear error.
"""

from __future__ import annotations

import jax


def is_hopper(device: jax.Device | None = None) -> bool:
  """True for an NVIDIA GPU of compute capability 9.x (H100, H200, GH200); False for any other device."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return False
  capability = str(getattr(device, "compute_capability", "") or "")
  return capability.split(".")[0] == "9"


def mosaic_gpu_runs(device: jax.Device | None = None) -> bool:
  """True where the Mosaic GPU kernels run: a Hopper GPU, or a CPU (Mosaic GPU's interpreter, `interpret=True`)."""
  device = device or jax.devices()[0]
  return device.platform == "cpu" or is_hopper(device)
