"""Shared test setup: CPU only, float32 matmuls at full precision, a tiny float32 model fixture, and the watchdog of
Mosaic GPU interpret-mode calls (`interpreted`)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from interpreter_watchdog import run_with_watchdog  # noqa: E402  # pylint: disable=import-error

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def interpreted():
  """`interpreted(lambda: f(...))`: a call that runs Mosaic GPU kernels in interpret mode, under the watchdog of
  `interpreter_watchdog.py` (retried when the interpreter's warpgroup threads starve XLA's CPU pool)."""
  return run_with_watchdog


@pytest.fixture(scope="session")
def tiny_config():
  import configs  # pylint: disable=g-import-not-at-top
  return configs.get("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
  from moe_jax import decode  # pylint: disable=g-import-not-at-top
  return decode.init_model(tiny_config, seed=0)
