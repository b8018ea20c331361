"""sharding.experiments' per-device bytes (JSON and markdown), without its timed and quality runs."""

import pytest

from moe_jax import decode
from sharding import memory, meshes, runner


@pytest.mark.needs_8_devices
def test_device_bytes_are_reported_beside_the_totals(tiny_config):
  # Imported here: importing it asks XLA for 8 CPU devices, which only this (child) process may have.
  from sharding import experiments  # pylint: disable=g-import-not-at-top
  model = decode.init_model(tiny_config.replace(n_layers=1, max_seq_len=32), seed=0)
  mesh = meshes.make_mesh(layout="2x4")
  got = experiments.device_bytes(model, mesh)
  assert got == memory.summary(runner.shard(model, mesh).state)
  assert got["expert_bytes_per_device_max"] == got["expert_bytes_per_device_min"] > 0
  settings = dict(batch=8, prompt_len=4, steps=1, penalty=1.0, target_remote_rate=0.1, tune_rounds=0, rank=4,
                  whiten=False, windows=1, prefix=2, context=8)
  res = dict(config="tiny", date="today", n_devices=8, device="cpu", platform="cpu", jax="x", model={},
             settings=settings, baseline_bpb=1.0, rows=[], sweep=[], surrogate_bytes_per_device={4: 1000},
             expert_bytes_total=8 * got["expert_bytes_per_device_max"])
  assert "Bytes each device holds" not in experiments.markdown(res)  # results written before it was measured
  res["bytes_per_device"] = [{"layout": "2x4", "routing": "exact", **got},
                             {"layout": "2x4", "routing": "lcvc", "error": "ValueError: no"}]
  text = experiments.markdown(res)
  mb = lambda b: f"{b / 1e6:.3f} MB"
  assert (f"| 2x4 | exact | {mb(got['state_bytes_per_device_max'])} | {mb(got['state_bytes_per_device_min'])} | "
          f"{mb(got['expert_bytes_per_device_max'])} | {mb(got['expert_bytes_per_device_min'])} |") in text
  assert "| 2x4 | lcvc | ValueError: no | | | |" in text
