"""Bytes each device holds of a sharded model's state (`sharding/memory.py`), bf16 and int4, on 8 CPU devices."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax import decode, quant
from sharding import memory, meshes, rules, runner


def test_sub_byte_leaves_count_packed_and_host_leaves_not_at_all():
  x = jnp.zeros((4, 8), jnp.int4)  # jax reports x.nbytes == 32 (a byte per value); stored packed: 16
  (only,) = memory.bytes_per_device({"a": x, "b": jnp.zeros((3,), jnp.bfloat16), "host": 1.5, "none": None}).values()
  assert only == 16 + 6


@pytest.mark.needs_8_devices
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("layout", ["2x4", "8x1"])
def test_expert_parallel_devices_each_hold_their_share_of_the_experts(tiny_config, fmt, layout):
  """Under layout "ep" the experts axis spans every device of the mesh and everything else is replicated, so exactly:
  expert bytes per device × devices per expert group (the 8 the experts axis spans) == `quant.expert_bytes(model)`,
  on every device alike, and state bytes per device == the replicated (non-expert) bytes + that share."""
  model = decode.init_model(tiny_config.replace(n_layers=1, max_seq_len=32, param_dtype="bfloat16"), seed=0)
  if fmt == "int4":
    model = quant.quantize_experts(model, "int4")
  mesh = meshes.make_mesh(layout=layout)
  sm = runner.shard(model, mesh)
  _, group = rules.devices_along(mesh, rules.RULES["ep"]["experts"])
  assert group == 8
  total = quant.expert_bytes(model)
  experts = memory.bytes_per_device(memory.expert_leaves(sm.state))
  assert sorted(d.id for d in experts) == list(range(8))
  assert all(b * group == total for b in experts.values()), (experts, total)
  everything = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model)))  # unsharded, host-side count
  replicated = everything - sum(int(x.nbytes) for x in jax.tree.leaves(memory.expert_leaves(nnx.state(model))))
  assert set(memory.bytes_per_device(sm.state).values()) == {replicated + total // group}
  state, share = replicated + total // group, total // group
  assert memory.summary(sm.state) == {"state_bytes_per_device_max": state, "state_bytes_per_device_min": state,
                                      "expert_bytes_per_device_max": share, "expert_bytes_per_device_min": share}


@pytest.mark.needs_8_devices
def test_tensor_parallel_heads_count_their_block_only(tiny_config):
  """Under "ep_tp" the attention heads split over "local" too: the devices' bytes sum to each leaf's bytes times the
  copies of each of its blocks (8 devices / the devices its PartitionSpec spans), and every device holds as much."""
  model = decode.init_model(tiny_config.replace(n_layers=1, max_seq_len=32), seed=0)
  mesh = meshes.make_mesh(layout="4x2")
  sm = runner.shard(model, mesh, layout="ep_tp")  # kv_heads=2 over local=2
  specs = jax.tree.leaves(sm.state_specs, is_leaf=lambda s: isinstance(s, P))
  spans = [math.prod(rules.devices_along(mesh, axes)[1] for axes in spec) for spec in specs]
  assert 2 in spans and 8 in spans and 1 in spans  # heads, experts and replicated leaves
  per_device = memory.bytes_per_device(sm.state)
  assert sum(per_device.values()) == sum(int(x.nbytes) * (8 // s) for x, s in zip(jax.tree.leaves(sm.state), spans))
  assert len(per_device) == 8 and len(set(per_device.values())) == 1
