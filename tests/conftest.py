"""Shared test setup: CPU only, float32 matmuls at full precision, and a tiny float32 model fixture."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def tiny_config():
  import configs  # pylint: disable=g-import-not-at-top
  return configs.get("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
  from moe_jax import decode  # pylint: disable=g-import-not-at-top
  return decode.init_model(tiny_config, seed=0)
