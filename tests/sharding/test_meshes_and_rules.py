"""Meshes, the rules table and the HLO collective parser (no compilation)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding import hlo_collectives as hc
from sharding import meshes, rules


@pytest.mark.needs_8_devices
@pytest.mark.parametrize("layout", ["1x8", "2x4", "4x2", "8x1"])
def test_simulated_mesh_axes_and_nodes(layout):
  n, l = meshes.parse_layout(layout)
  mesh = meshes.make_mesh(layout=layout)
  assert mesh.axis_names == ("node", "local") and (mesh.shape["node"], mesh.shape["local"]) == (n, l)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  np.testing.assert_array_equal(ids.reshape(-1), np.arange(8))  # node-major
  np.testing.assert_array_equal(meshes.device_nodes(mesh), np.arange(8) // l)


@pytest.mark.needs_8_devices
def test_process_mesh_groups_by_process_index():
  mesh = meshes.process_mesh()  # one process here: one node holding every device
  assert (mesh.shape["node"], mesh.shape["local"]) == (1, jax.device_count())


def test_parse_layout_errors_name_the_layout():
  with pytest.raises(ValueError, match="layout='2by4'"):
    meshes.parse_layout("2by4")
  with pytest.raises(ValueError, match="needs 16 devices"):
    meshes.simulated_mesh(4, 4, devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="n_nodes=0 must be a positive int"):
    meshes.make_mesh(nodes=0)  # was a ZeroDivisionError
  with pytest.raises(ValueError, match="n_local=-2 must be a positive int"):
    meshes.simulated_mesh(1, -2)


def test_rules_table_maps_logical_axes():
  assert rules.spec(("experts", "embed", "expert_mlp"), "ep") == P(("node", "local"), None, None)
  assert rules.spec(("embed", "heads", "head_dim"), "ep_tp") == P(None, "local", None)
  assert rules.activation_spec("tokens", "ep") == P(("node", "local"), None)
  assert rules.activation_spec("tokens", "ep_tp") == P("node", None)
  assert rules.param_logical_axes(["blocks", "0", "ffn", "w_gate"], 3) == ("experts", "embed", "expert_mlp")
  assert rules.param_logical_axes(["blocks", "0", "ffn", "shared", "w_gate"], 2) == ("embed", "mlp")
  assert rules.param_logical_axes(["blocks", "0", "ffn", "w_down", "scales"], 2) == ("experts", None)
  assert rules.param_logical_axes(["blocks", "0", "ffn", "surrogate", "gate_a"], 3)[0] == "surrogate_experts"
  with pytest.raises(ValueError, match="layout='dp'"):
    rules.spec(("embed",), "dp")


def test_every_tiny_parameter_has_logical_axes(tiny_model):
  from flax import nnx
  _, state = nnx.split(tiny_model)
  specs = rules.tree_specs(state, "ep")
  leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
  experts = [jax.tree_util.keystr(p) for p, s in leaves if s and s[0] == ("node", "local")]
  assert len(experts) == 3 * tiny_model.config.n_layers  # w_gate, w_up, w_down of every MoE layer


NODE_OF = np.repeat(np.arange(2), 4)  # 2 nodes x 4


@pytest.mark.parametrize("groups,spans", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", False),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", True),
    ("replica_groups=[2,4]<=[8]", False),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", True),
    ("replica_groups=mesh['node'=2,'local'=4] {'local'}", False),
    ("replica_groups=mesh['node'=2,'local'=4] {'node'}", True),
    ("replica_groups=mesh['node'=2,'local'=4] {'node','local'}", True),
    ("replica_groups={}", True),
])
def test_replica_group_spellings(groups, spans):
  line = f"  %a2a = f32[8,64]{{1,0}} all-to-all(f32[8,64]{{1,0}} %x), channel_id=1, {groups}, dimensions={{0}}"
  (c,) = hc.collectives(line, 8)
  assert c.op == "all-to-all" and c.bytes_out == 8 * 64 * 4
  assert sorted(v for g in c.groups for v in g) == list(range(8))
  assert hc.spans_nodes(c, NODE_OF) == spans
  assert (hc.cross_node_bytes(c, NODE_OF) > 0) == spans


def test_cross_node_bytes_of_an_all_to_all():
  line = "%a = (f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%p, %q), replica_groups={{0,1,2,3,4,5,6,7}}"
  (c,) = hc.collectives(line, 8)
  # 128 bytes per device, 16 to each of 7 peers, 4 of them on the other node; 8 devices.
  assert hc.cross_node_bytes(c, NODE_OF) == 8 * 4 * 16
  permute = "%p = bf16[4]{0} collective-permute-start(%x), source_target_pairs={{0,1},{3,4},{4,0}}"
  (c,) = hc.collectives(permute, 8)
  assert hc.spans_nodes(c, NODE_OF) and hc.cross_node_bytes(c, NODE_OF) == 2 * 8


@pytest.mark.parametrize("line, result_bytes", [
    # GPU's async forms hold their operands too; only the result counts (before: the whole tuple, 2x on the GPU).
    ("%a = ((f32[2,16,256]{2,1,0}), f32[2,16,256]{2,1,0}) all-to-all-start(f32[2,16,256]{2,1,0} %x)", 32768),
    ("%r = ((f32[64]{0}, f32[64]{0}, s64[2]{0}, s64[2]{0}, s64[2]{0}, s64[2]{0}), f32[64]{0}, u32[]) "
     "ragged-all-to-all-start(%i, %o, %a, %b, %c, %d)", 256),
    ("%g = (f32[4]{0}, f32[8]{0}) all-gather-start(f32[4]{0} %x)", 32),
    ("%g = ((f32[4]{0}, bf16[4]{0}), (f32[8]{0}, bf16[8]{0})) all-gather-start(%x, %y)", 48),
    ("%p = (bf16[4]{0}, bf16[4]{0}, u32[], u32[]) collective-permute-start(bf16[4]{0} %x)", 8),
    ("%s = f32[8]{0} all-reduce-start(f32[8]{0} %x)", 32),
    ("%t = (f32[8]{0}, f32[8]{0}) all-reduce-start(%x, %y)", 64),  # variadic: both results
    ("%u = (f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%p, %q)", 128),  # synchronous variadic: both results
])
def test_async_start_forms_count_their_result_only(line, result_bytes):
  (c,) = hc.collectives(line + ", replica_groups={{0,1,2,3,4,5,6,7}}", 8)
  assert c.bytes_out == result_bytes


@pytest.mark.needs_8_devices
def test_one_codebook_for_all_experts_is_replicated(tiny_config):
  """Leaves of a quantized expert weight shard on the experts axis, except a leading axis of size 1 (vq2's per-layer
  codebook, one for every expert), which is replicated: the state then goes onto a 2 x 4 mesh (a size-1 axis sharded
  8 ways is refused by device_put)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from moe_jax import decode, quant  # pylint: disable=g-import-not-at-top
  spec = quant.QuantSpec("vq2", codebook="layer", kmeans_iters=2)  # only the leaves' shapes matter here
  model = quant.quantize_experts(decode.init_model(tiny_config, seed=0), spec)
  state = nnx.state(model)
  specs = rules.tree_specs(state, "ep")
  leaves = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]}
  books = [k for k in leaves if k.endswith(".codebook")]
  indices = [k for k in leaves if k.endswith(".idx")]
  assert len(books) == len(indices) == 3 * tiny_config.n_layers
  assert all(leaves[k] == P(None, None, None) for k in books)
  assert all(leaves[k] == P(("node", "local"), None, None) for k in indices)
  placed = jax.device_put(state, rules.named(meshes.make_mesh(layout="2x4"), specs))
  assert len(jax.tree.leaves(placed)) == len(jax.tree.leaves(state))
