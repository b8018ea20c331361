"""A real multi-process run: P processes on this host, each with its own CPU devices, joined by
`jax.distributed.initialize` (gloo collectives on CPU), one node per process.

    python -m sharding.multiprocess --processes=2 --devices_per_process=4 --out=/tmp/mp.npz

launches the workers (`--process_id=i`) itself; each builds the same tiny model (fixed seed), routes it by LCVC with
a non-zero penalty (so that the token-to-node mapping matters), shards it over the process mesh (e.g. 2 nodes × 4), runs
the full causal pass (and with --decode one prefill + decode step), and process 0 writes the gathered logits to --out.
Any process count that divides the tiny model's experts works; the batch is 8 or the next multiple of the devices.
`tests/sharding/test_multiprocess.py` compares them with the same computation in one process, on one device.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from absl import app, flags

from sharding import cpu_devices

FLAGS = flags.FLAGS

LENGTH, CACHE_LEN, SEED = 12, 16, 0


def batch_size(processes: int, devices_per_process: int) -> int:
  """Sequences of the run: 8, or the smallest multiple of the device count above it (each device holds rows)."""
  n = processes * devices_per_process
  return -(-8 // n) * n


def check_layout(processes: int, devices_per_process: int) -> None:
  """Raises ValueError naming the flag when the run cannot shard the model (before any worker starts)."""
  import configs  # pylint: disable=g-import-not-at-top
  for name, value in (("processes", processes), ("devices_per_process", devices_per_process)):
    if value < 1:
      raise ValueError(f"--{name}={value} must be >= 1")
  n_experts = configs.get("tiny").n_experts
  if n_experts % processes:
    raise ValueError(f"--processes={processes} must divide the tiny model's {n_experts} experts (one node each)")


def reference_inputs(n_nodes: int = 2, batch: int = 8):
  """The model and inputs every process (and the single-process reference) builds: (model, tokens, next tokens);
  LCVC over `n_nodes` nodes (one per process), `batch` sequences."""
  import jax  # pylint: disable=g-import-not-at-top
  import configs  # pylint: disable=g-import-not-at-top
  from moe_jax import decode, locality  # pylint: disable=g-import-not-at-top

  config = configs.get("tiny").replace(n_layers=1, max_seq_len=CACHE_LEN)
  model = decode.init_model(config, seed=SEED)
  model = locality.with_lcvc(model, locality.LCVCConfig(n_nodes=n_nodes, penalty=0.5, threshold=0.3))
  tokens = jax.random.randint(jax.random.key(1), (batch, LENGTH), 0, 256)
  nxt = jax.random.randint(jax.random.key(2), (batch,), 0, 256)
  return model, tokens, nxt


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{FLAGS.port}", num_processes=FLAGS.processes,
                             process_id=FLAGS.process_id)
  from sharding import meshes, runner  # pylint: disable=g-import-not-at-top

  mesh = meshes.process_mesh()
  batch = batch_size(FLAGS.processes, jax.local_device_count())
  model, tokens, nxt = reference_inputs(n_nodes=FLAGS.processes, batch=batch)
  print(f"process {jax.process_index()}: initialised at {time.time():.1f}", flush=True)
  t0 = time.perf_counter()
  sm = runner.shard(model, mesh)
  logits = sm.logits(tokens)
  arrays = {"logits": logits}
  if FLAGS.decode:
    lengths = np.full((batch,), LENGTH, np.int32)
    _, cache = sm.prefill(tokens, lengths, kv_cache="fp32", cache_len=CACHE_LEN)
    arrays["step"], _ = sm.decode_step(cache, nxt)
  arrays = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in arrays.items()}
  print(f"process {jax.process_index()}: sharded run {time.perf_counter() - t0:.1f} s", flush=True)
  if jax.process_index() == 0:
    np.savez(FLAGS.out, **arrays,
             mesh=np.array([mesh.shape["node"], mesh.shape["local"]]), process_count=jax.process_count())
  print(f"process {jax.process_index()}: shutting down at {time.time():.1f}", flush=True)
  jax.distributed.shutdown()
  print(f"process {jax.process_index()}: done at {time.time():.1f}", flush=True)


def launch() -> int:
  check_layout(FLAGS.processes, FLAGS.devices_per_process)
  port = FLAGS.port or free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=cpu_devices.with_device_count(os.environ.get("XLA_FLAGS", ""), FLAGS.devices_per_process))
  procs = [subprocess.Popen([sys.executable, "-m", "sharding.multiprocess", f"--process_id={i}", f"--port={port}",
                             f"--processes={FLAGS.processes}", f"--out={FLAGS.out}",
                             f"--decode={FLAGS.decode}"], env=env)
           for i in range(FLAGS.processes)]
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=FLAGS.timeout))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      return 124
  return max(abs(c) for c in codes)


def main(argv):
  del argv
  if FLAGS.process_id >= 0:
    worker()
  else:
    sys.exit(launch())


if __name__ == "__main__":
  flags.DEFINE_integer("processes", 2, "Processes (nodes).")
  flags.DEFINE_integer("devices_per_process", 4, "CPU devices per process.")
  flags.DEFINE_integer("process_id", -1, "Set by the launcher for a worker; -1 launches the workers.")
  flags.DEFINE_integer("port", 0, "Coordinator port (0: pick a free one).")
  flags.DEFINE_string("out", "/tmp/moe_jax_multiprocess.npz", "Where process 0 writes the logits.")
  flags.DEFINE_bool("decode", False, "Also run a sharded prefill and one decode step.")
  flags.DEFINE_integer("timeout", 240, "Seconds before the launcher gives up on the workers.")
  app.run(main)
