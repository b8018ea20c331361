"""Shared test setup: CPU only, XLA's CPU backend at LLVM optimization level 0, float32 matmuls at full precision, a
tiny float32 model fixture, and the watchdog of Mosaic GPU interpret-mode calls (`interpreted`).

Most of the suite's time is XLA compiling small programs (and the interpreters' per-op programs), which run once on
tiny inputs: `--xla_backend_optimization_level=0` cut a compile-bound file by ~27% and an interpreter-bound one by
~31% on the 2-core machine. It changes LLVM's code generation only, not the HLO or its float semantics checked here.
The flag travels in XLA_FLAGS to the processes that tests start (notebook kernels, the 8-device and multi-process
children).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
CPU_TEST_FLAG = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_TEST_FLAG}".strip()

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
