"""Which devices run the Mosaic GPU kernels (`pallas_kernels.hopper`), and the clear error of the int4_mgpu experts
on a GPU that is not a Hopper."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import hopper


@dataclasses.dataclass
class _Device:
  platform: str
  compute_capability: str | None = None
  device_kind: str = "fake"


@pytest.mark.parametrize("device,want_hopper,want_runs", [
    (_Device("gpu", "9.0"), True, True), (_Device("gpu", "9.0a"), True, True), (_Device("gpu", "8.0"), False, False),
    (_Device("gpu", "10.0"), False, False), (_Device("gpu", None), False, False), (_Device("cpu"), False, True),
    (_Device("tpu"), False, False)])
def test_hopper_devices(device, want_hopper, want_runs):
  assert hopper.is_hopper(device) == want_hopper
  assert hopper.mosaic_gpu_runs(device) == want_runs


def test_this_cpu_runs_the_interpreter():
  assert jax.devices()[0].platform == "cpu" and hopper.mosaic_gpu_runs() and not hopper.is_hopper()


def test_int4_mgpu_experts_refuse_other_gpus(monkeypatch):
  from moe_jax.quant import kernels  # pylint: disable=g-import-not-at-top
  from moe_jax.quant.formats import QuantizedExperts  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(hopper, "mosaic_gpu_runs", lambda device=None: False)
  w = QuantizedExperts(data=None, kind="int4_mgpu", k=128, group_size=128)
  with pytest.raises(ValueError, match="int4_mgpu.*Hopper"):
    kernels.pallas_grouped_matmul(jnp.zeros((4, 128), jnp.bfloat16), w, jnp.array([4], jnp.int32))
