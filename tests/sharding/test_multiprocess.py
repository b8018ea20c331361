"""Two processes × 4 CPU devices through `jax.distributed.initialize` (gloo), one node per process, give the same
logits as one process on one device."""

import os
import subprocess
import sys

import numpy as np

from moe_jax import decode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_processes_match_one(tmp_path):
  out = tmp_path / "mp.npz"
  env = {k: v for k, v in os.environ.items() if k != "MOE_JAX_SHARDING_RERUN"}  # launch() sets the device count
  r = subprocess.run([sys.executable, "-m", "sharding.multiprocess", "--processes=2", "--devices_per_process=4",
                      f"--out={out}", "--timeout=240"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-4000:]
  got = np.load(out)
  assert got["process_count"] == 2 and got["mesh"].tolist() == [2, 4]

  from sharding import multiprocess  # pylint: disable=g-import-not-at-top
  model, tokens, _ = multiprocess.reference_inputs()  # LCVC with λ > 0: the token-to-node mapping matters
  np.testing.assert_allclose(got["logits"], decode.logits(model, tokens), rtol=1e-5, atol=1e-5)


def test_device_count_flag_replaces_the_callers_and_keeps_the_rest():
  from sharding.cpu_devices import with_device_count  # pylint: disable=g-import-not-at-top
  got = with_device_count("--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8", 4)
  assert got == "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4"
  assert with_device_count("", 2) == "--xla_force_host_platform_device_count=2"
