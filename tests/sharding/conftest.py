"""8 simulated CPU devices for the sharding tests, without changing the device count of anyone else's tests.

XLA fixes the CPU device count when its backend starts, once per process, and other tests (data-parallel training)
depend on having one device. So the tests marked `needs_8_devices` run in a child pytest process, one per test
file, started with XLA_FLAGS=--xla_force_host_platform_device_count=8; each test here then reports its
counterpart's outcome (failures with the child's traceback). When this process already has >= 8 devices
(XLA_FLAGS set by the caller), they run in-process.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from sharding.cpu_devices import with_device_count
CHILD_ENV = "MOE_JAX_SHARDING_CHILD_REPORT"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_child_results: dict[str, dict] = {}  # test file -> {nodeid: {"outcome", "text"}}
_recorded: dict[str, dict] = {}  # in a child: what it ran


def pytest_configure(config):
  config.addinivalue_line("markers", "needs_8_devices: runs on 8 simulated CPU devices (a child process)")


def _run_child(path: str) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.json")
    env = dict(os.environ, XLA_FLAGS=with_device_count(os.environ.get("XLA_FLAGS", ""), 8), JAX_PLATFORMS="cpu",
               **{CHILD_ENV: report})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-m", "needs_8_devices", os.path.relpath(path, ROOT)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    if not os.path.exists(report):
      return {"__error__": {"outcome": "failed", "text": f"child pytest wrote no report:\n{r.stdout[-3000:]}\n"
                                                         f"{r.stderr[-3000:]}"}}
    with open(report) as f:
      return json.load(f)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if pyfuncitem.get_closest_marker("needs_8_devices") is None or os.environ.get(CHILD_ENV):
    return None
  import jax  # pylint: disable=g-import-not-at-top
  if jax.device_count() >= 8:
    return None
  path = str(pyfuncitem.path)
  if path not in _child_results:
    _child_results[path] = _run_child(path)
  results = _child_results[path]
  result = results.get(pyfuncitem.nodeid) or results.get("__error__") or {
      "outcome": "failed", "text": f"{pyfuncitem.nodeid} did not run in the child process"}
  if result["outcome"] == "skipped":
    pytest.skip(result["text"])
  if result["outcome"] != "passed":
    pytest.fail(f"in the 8-device child process:\n{result['text']}", pytrace=False)
  return True


def pytest_runtest_logreport(report):
  if not os.environ.get(CHILD_ENV):
    return
  if report.when == "call" or report.outcome != "passed":
    if report.nodeid not in _recorded or _recorded[report.nodeid]["outcome"] == "passed":
      _recorded[report.nodeid] = {"outcome": report.outcome, "text": report.longreprtext[-6000:]}


def pytest_sessionfinish(session):
  path = os.environ.get(CHILD_ENV)
  if path:
    with open(path, "w") as f:
      json.dump(_recorded, f)
