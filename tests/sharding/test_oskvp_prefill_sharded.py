"""The batched OS-KVP prefill fits (`OSKVPMode.from_prefill_layers`) with the batch sharded over devices: the layers'
sequences are stacked sequence-major, so a batch-sharded build compiles to the per-layer build's collectives (no
data moved between devices), and gives its caches."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.kv_cache import prefill_layers
from moe_jax.kv_quant import OSKVPMode

B, T, K, H, R, L = 8, 80, 2, 32, 24, 4
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def _collectives(compiled_text: str) -> dict[str, int]:
  return {op: len(re.findall(rf"\b{op}(-start)?\(", compiled_text)) for op in COLLECTIVES}


@pytest.mark.needs_8_devices
def test_a_batch_sharded_prefill_fits_its_layers_without_collectives():
  """B = 8 sequences over 8 devices, 4 layers fitted two at a time (chunk 16): the compiled build has the per-layer
  build's collectives (one all-reduce; before, stacking the layers layer-major moved rows between devices: permutes,
  all-to-alls and an all-gather), and the caches of the unsharded per-layer build."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))
  kvs = [tuple(jax.random.normal(jax.random.PRNGKey(10 * i + j), (B, T, K, H)) for j in (0, 1)) for i in range(L)]
  lengths = jnp.array([80, 60, 40, 30, 80, 25, 79, 50])
  ref = jax.jit(lambda kv: prefill_layers(OSKVPMode(window=R, fit_implementation="xla", prefill_across_layers=False),
                                          kv, lengths, T + R))(kvs)
  rows = NamedSharding(mesh, P("batch"))
  kv_sharded = [tuple(jax.device_put(x, rows) for x in kv) for kv in kvs]
  counts, builds = {}, {}
  for across in (True, False):
    mode = OSKVPMode(window=R, fit_implementation="xla", prefill_across_layers=across)
    builds[across] = jax.jit(lambda kv, n, m=mode: prefill_layers(m, kv, n, T + R))
    counts[across] = _collectives(builds[across].lower(kv_sharded, jax.device_put(lengths, rows)).compile().as_text())
  assert OSKVPMode().prefill_fit_chunk // B == 2  # two layers a fit
  # The same collectives as layer by layer: one all-reduce, the "all prompts short?" of the fits' cond.
  assert counts[True] == counts[False] and counts[True]["all-reduce"] <= 1, counts
  assert not any(counts[True][op] for op in ("all-gather", "collective-permute", "all-to-all")), counts
  got = builds[True](kv_sharded, jax.device_put(lengths, rows))
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
