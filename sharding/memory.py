"""Bytes each device holds of a placed parameter tree (a `ShardedModel.state`, quantized or not).

Read from the arrays themselves (`jax.Array.addressable_shards`), not from the rules table, so the count is exact
for any sharding: a replicated leaf counts whole on every device that holds a copy, a sharded one counts each
device's block. Sub-byte dtypes (int4) count packed, two values a byte, as `QuantizedExperts.nbytes` counts them.
"""

from __future__ import annotations

import collections

import jax

from sharding import rules


def _shard_bytes(x: jax.Array) -> int:
  return (int(x.size) * jax.dtypes.itemsize_bits(x.dtype) + 7) // 8


def bytes_per_device(tree) -> dict[jax.Device, int]:
  """Bytes of the `jax.Array` leaves of `tree` on each device of this process that holds any of them.

  Args:
    tree: any pytree, e.g. an `nnx.State` placed by `sharding.runner.shard`; leaves other than `jax.Array`
      (NumPy arrays, Python scalars, None) live on the host and are not counted.

  Returns:
    {device: bytes}; its values sum to each leaf's bytes times the devices holding a copy of each block of it.
  """
  out = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      for shard in leaf.addressable_shards:
        out[shard.device] += _shard_bytes(shard.data)
  return dict(out)


def expert_leaves(state):
  """`state` with only the leaves of routed expert weights (logical axis "experts" first in `sharding.rules`, the
  codes and scales of a quantized one included), the other leaves None (so `bytes_per_device` skips them)."""
  def keep(path, x):
    if not hasattr(x, "ndim"):
      return None
    axes = rules.param_logical_axes(rules.leaf_path_names(path), x.ndim)
    return x if axes[:1] == ("experts",) else None
  return jax.tree_util.tree_map_with_path(keep, state)


def summary(state) -> dict[str, int]:
  """{"state_bytes_per_device_max", "state_bytes_per_device_min", "expert_bytes_per_device_max",
  "expert_bytes_per_device_min"} of a placed parameter tree, over the devices that hold any of it."""
  out = {}
  for name, tree in (("state", state), ("expert", expert_leaves(state))):
    per_device = list(bytes_per_device(tree).values()) or [0]
    out[f"{name}_bytes_per_device_max"] = max(per_device)
    out[f"{name}_bytes_per_device_min"] = min(per_device)
  return out
