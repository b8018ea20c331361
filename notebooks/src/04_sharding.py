# %% [markdown]
# # Locality-aware expert parallelism at tiny size
# Eight simulated CPU devices arranged as `node x local` meshes; the tiny model's experts split over both axes;
# LCVC routing keeps most tokens on their own node, and low-rank surrogates serve the remaining remote experts so
# that the decode step has no collective across nodes. Everything here imports the package.

# %%
import os

from sharding.cpu_devices import with_device_count

# 8 CPU devices, the other XLA flags kept; before JAX starts its CPU backend.
os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), 8)

import jax
import jax.numpy as jnp
import numpy as np

import configs
from moe_jax import decode, locality
from sharding import hlo_collectives, meshes, rules, runner

jax.config.update("jax_default_matmul_precision", "highest")
config = configs.get("tiny").replace(n_layers=1, max_seq_len=32)
model = decode.init_model(config, seed=0)
jax.device_count()

# %% [markdown]
# ## Layouts: the same 8 devices as 1x8, 2x4, 4x2, 8x1 (nodes x devices per node)
# Devices are node-major; `device_nodes` is the node of each mesh position. The rules table maps logical axes to
# mesh axes: under layout "ep" the experts and the batch are split over both axes, attention weights replicated.

# %%
for layout in ["1x8", "2x4", "4x2", "8x1"]:
  mesh = meshes.make_mesh(layout=layout)
  print(layout, dict(mesh.shape), "nodes of devices:", meshes.device_nodes(mesh))
{name: rules.spec(rules.PARAM_AXES[name], "ep") for name in ["ffn/w_gate", "attn/wq", "embedding"]}

# %% [markdown]
# ## Expert-parallel model = single-device model (λ = 0, surrogates off)

# %%
tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 256)
mesh = meshes.make_mesh(layout="2x4")
sharded = runner.shard(locality.with_lcvc(model, locality.LCVCConfig(n_nodes=2, penalty=0.0)), mesh)
float(jnp.max(jnp.abs(sharded.logits(tokens) - decode.logits(model, tokens))))

# %% [markdown]
# ## LCVC routing: fewer remote experts as λ grows (τ tuned online toward a 10% remote rate)

# %%
lcvc = locality.make_lcvc(model, locality.LCVCConfig(n_nodes=2, penalty=0.0, target_remote_rate=0.1,
                                                     threshold_step=0.05, surrogates=True), rank=8)
for lam in [0.0, 0.1, 1.0]:
  locality.set_penalty(lcvc, lam, threshold=0.5)
  if lam:
    locality.tune_thresholds(lcvc, [tokens] * 4)
  print(f"λ={lam}: remote rate {float(locality.routing_stats(lcvc, tokens)['remote_rate'].mean()):.3f}")

# %% [markdown]
# ## The decode step's collectives, read from the compiled HLO
# Exact routing moves tokens across nodes; LCVC with surrogates uses an all-to-all inside each node only.

# %%
lengths = jnp.full((8,), 12, jnp.int32)
nxt = jax.random.randint(jax.random.key(2), (8,), 0, 256)
for name, sm in [("exact", runner.shard(lcvc, mesh)), ("lcvc + surrogates", runner.shard(lcvc, mesh, surrogate_decode=True))]:
  _, cache = sm.prefill(tokens, lengths, kv_cache="fp32", cache_len=16)
  summary = hlo_collectives.summarize(sm.decode_hlo(cache, nxt), meshes.device_nodes(mesh))
  print(f"{name:18s} collectives {summary['n_collectives']}, across nodes {summary['n_cross_node']}, "
        f"bytes across nodes {summary['cross_node_bytes']:.0f}")
