"""8 simulated CPU devices for the sharding tests.

XLA reads XLA_FLAGS when the backend starts (on first use, not on `import jax`), so setting it here, at collection,
is early enough when this directory's tests are collected before any test has run. Should the backend have started
with fewer devices anyway (another test ran first in this process), a test marked `needs_8_devices` reruns alone in
a fresh interpreter and its outcome is that run's.
"""

import os
import subprocess
import sys

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
  config.addinivalue_line("markers", "needs_8_devices: runs on 8 (simulated) devices")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if pyfuncitem.get_closest_marker("needs_8_devices") is None:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  if jax.device_count() >= 8:
    return None
  if os.environ.get("MOE_JAX_SHARDING_RERUN"):
    pytest.fail(f"only {jax.device_count()} devices even in a fresh interpreter")
  env = dict(os.environ, MOE_JAX_SHARDING_RERUN="1", XLA_FLAGS=_FLAG, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                      pyfuncitem.nodeid], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  if r.returncode:
    pytest.fail(f"rerun in a fresh interpreter failed:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}")
  return True
