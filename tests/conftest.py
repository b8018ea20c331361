"""Shared test setup: CPU only, compiles made cheaper (below), float32 matmuls at full precision, a tiny float32 model
fixture, and the watchdog of Mosaic GPU interpret-mode calls (`interpreted`).

Most of the suite's time is XLA compiling small programs (and the interpreters' per-op programs) that then run once
on tiny inputs. Three settings, carried in the environment to every process a test starts (xdist workers, notebook
kernels, the 8-device and multi-process children):
- `--xla_backend_optimization_level=0`: LLVM's optimization level for the CPU code (the HLO is unchanged). On the
  2-core machine it cut a compile-bound file by ~27% and an interpreter-bound one by ~31%; programs that run long
  (k-means, the serving load tests) run slower, and the suite as a whole took 20.8 instead of 25.5 minutes.
- a persistent compilation cache in a fresh temporary directory per run (removed at exit by the process that made
  it): programs with the same HLO compiled in another process, or by another `jax.jit` object, are read back
  instead of compiled again.
- one OpenBLAS thread (below): numpy's and jax's CPU linear algebra on tiny matrices, with the cores already busy.
And in each pytest process, Python's full (generation 2) garbage collections made ten times rarer, with the objects
alive after the imports left out of them (`gc.freeze`): a full collection walks every live object, the heap grows
with jax's caches over a worker's files, and the full collections took ~20 s of each worker's run (25-30 of them).
After each test, jax's caches are cleared once the process holds half the kernel's limit on memory mappings
(`map_budget.py`): every compiled executable is mapped into the process, and workers that ran into that limit
crashed.
"""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenBLAS thread (numpy's, and scipy's, which jax's CPU eigh / qr call): with both cores busy its threads mostly
# wait on each other. Measured on the 2-core machine under the suite's load: 40 QRs of [128, 128] 0.75-0.99 s against
# 0.03-0.04 s, five batched eighs (jitted, 64 x [64, 64]) 0.25-0.70 s against 0.07 s. Read when numpy first loads,
# which is after this file in every test process (and in the processes the tests start, by inheritance).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
CPU_TEST_FLAG = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_TEST_FLAG}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="moe_jax_tests_jit_cache_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

from interpreter_watchdog import run_with_watchdog  # noqa: E402  # pylint: disable=import-error
from map_budget import release_if_over  # noqa: E402  # pylint: disable=import-error
from worker_crash_report import (  # noqa: E402,F401  # pylint: disable=import-error,unused-import
    note, pytest_configure, pytest_runtest_logstart, pytest_testnodedown)

jax.config.update("jax_default_matmul_precision", "highest")
gc.freeze()
gc.set_threshold(700, 10, 100)  # a full collection after 100 generation-1 collections instead of 10


@pytest.fixture(autouse=True)
def _mappings_under_the_limit(request):
  """After each test: jax's caches cleared once the process holds half the kernel's limit on memory mappings
  (`map_budget.py`: running into that limit crashed workers), except after tests marked `keep_jax_caches` (they
  assert that jitted steps warmed by an earlier test are not traced again)."""
  yield
  if request.node.get_closest_marker("keep_jax_caches"):
    return
  released = release_if_over()
  if released:
    note(f"cleared jax's caches at {released[0]} memory mappings ({released[1]} after)")


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
