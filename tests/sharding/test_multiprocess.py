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


def test_other_process_counts_get_their_own_nodes_and_batch():
  """Before, the workers' model had LCVC n_nodes = 2 whatever --processes said, so any other count failed in every
  worker (4 processes × 2 devices now match one device within 1.9e-6, run by hand: 59 s on 2 cores)."""
  import pytest  # pylint: disable=g-import-not-at-top
  from sharding import multiprocess  # pylint: disable=g-import-not-at-top
  assert [multiprocess.batch_size(p, d) for p, d in ((2, 4), (4, 4), (1, 3))] == [8, 16, 9]
  model, tokens, _ = multiprocess.reference_inputs(n_nodes=4, batch=16)
  assert tokens.shape == (16, multiprocess.LENGTH) and model.blocks[0].ffn.lcvc.n_nodes == 4
  multiprocess.check_layout(4, 2)
  with pytest.raises(ValueError, match=r"--processes=3 must divide the tiny model's 8 experts"):
    multiprocess.check_layout(3, 2)
  with pytest.raises(ValueError, match=r"--devices_per_process=0 must be >= 1"):
    multiprocess.check_layout(2, 0)
