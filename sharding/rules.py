"""The one logical-axis rules table: parameter and activation axes -> mesh axes, per layout.

Every parameter and activation axis has a logical name (embed, heads, kv_heads, head_dim, experts, expert_mlp, mlp,
vocab, batch, sequence, ...); a layout maps each name to a mesh axis, a tuple of mesh axes, or None (replicated).

| layout | attention | experts | how it runs |
|---|---|---|---|
| "ep" | data-parallel: batch over ("node", "local"), weights replicated | expert-parallel over ("node", "local") | one `shard_map` over the whole step (`sharding/runner.py`) |
| "ep_tp" | batch over "node", tensor-parallel heads within a node ("local") | expert-parallel over ("node", "local") | `jax.jit` with these shardings (the compiler partitions) |
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.meshes import LOCAL, NODE

BOTH = (NODE, LOCAL)

RULES: dict[str, dict[str, Any]] = {
    "ep": {
        "batch": BOTH, "sequence": None, "embed": None, "vocab": None, "heads": None, "kv_heads": None,
        "head_dim": None, "experts": BOTH, "expert_mlp": None, "mlp": None, "router_experts": None, "norm": None,
        "surrogate_experts": None, "rank": None, "cache_sequence": None,
    },
    "ep_tp": {
        "batch": NODE, "sequence": None, "embed": None, "vocab": None, "heads": LOCAL, "kv_heads": LOCAL,
        "head_dim": None, "experts": BOTH, "expert_mlp": None, "mlp": LOCAL, "router_experts": None, "norm": None,
        "surrogate_experts": None, "rank": None, "cache_sequence": None,
    },
}

# Logical axes of every parameter, by its last path names.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embedding": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "attn/wq": ("embed", "heads", "head_dim"),
    "attn/wk": ("embed", "kv_heads", "head_dim"),
    "attn/wv": ("embed", "kv_heads", "head_dim"),
    "attn/wo": ("heads", "head_dim", "embed"),
    "attn/bq": ("heads", "head_dim"),
    "attn/bk": ("kv_heads", "head_dim"),
    "attn/bv": ("kv_heads", "head_dim"),
    "scale": ("norm",),
    "ffn/w_router": ("embed", "router_experts"),
    "ffn/router_bias": ("router_experts",),
    "ffn/threshold": (),
    "ffn/penalty": (),
    "ffn/w_shared_gate": ("embed", None),
    "ffn/w_gate": ("experts", "embed", "expert_mlp"),
    "ffn/w_up": ("experts", "embed", "expert_mlp"),
    "ffn/w_down": ("experts", "expert_mlp", "embed"),
    "w_gate": ("embed", "mlp"),  # dense FFN and shared expert
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "surrogate/gate_a": ("surrogate_experts", "embed", "rank"),
    "surrogate/up_a": ("surrogate_experts", "embed", "rank"),
    "surrogate/gate_b": ("surrogate_experts", "rank", "expert_mlp"),
    "surrogate/up_b": ("surrogate_experts", "rank", "expert_mlp"),
    "surrogate/down_a": ("surrogate_experts", "expert_mlp", "rank"),
    "surrogate/down_b": ("surrogate_experts", "rank", "embed"),
}

ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "tokens": ("batch", "sequence"),  # int32 [B, T]
    "lengths": ("batch",),  # int32 [B]
    "logits": ("batch", "sequence", "vocab"),  # [B, T, V]
    "step_logits": ("batch", "vocab"),  # [B, V]
    "step_tokens": ("batch",),  # [B]
    "kv": ("batch", "cache_sequence", "kv_heads", "head_dim"),  # [B, S, K, H]
}


def _check_layout(layout: str) -> dict[str, Any]:
  if layout not in RULES:
    raise ValueError(f"layout={layout!r} is not a sharding layout; choose one of {sorted(RULES)}")
  return RULES[layout]


def spec(logical: tuple[str | None, ...], layout: str) -> P:
  """Logical axes -> PartitionSpec under `layout` (None stays replicated)."""
  rules = _check_layout(layout)
  return P(*(None if name is None else rules[name] for name in logical))


def activation_spec(name: str, layout: str) -> P:
  return spec(ACTIVATION_AXES[name], layout)


def leaf_path_names(path) -> list[str]:
  """A pytree key path -> its names, e.g. ['blocks', '0', 'ffn', 'w_gate'] (nnx's "value" entries dropped)."""
  names = []
  for entry in path:
    key = getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", None)))
    names.append(str(key))
  return [n for n in names if n not in ("value", "raw_value")]


def param_logical_axes(path_names: list[str], ndim: int) -> tuple[str | None, ...]:
  """Logical axes of one parameter leaf from its path, e.g. [..., 'ffn', 'w_gate'] (ndim 3) -> experts axes.

  Leaves below an expert weight (e.g. the codes and scales of a quantized weight) keep the experts axis first and
  replicate the rest; unknown leaves are replicated.
  """
  names = [n for n in path_names if not n.isdigit()]
  for length in (2, 1):
    key = "/".join(names[-length:])
    if key in PARAM_AXES and len(PARAM_AXES[key]) == ndim:
      return PARAM_AXES[key]
  for i, n in enumerate(names[:-1]):
    if n in ("w_gate", "w_up", "w_down") and i > 0 and names[i - 1] == "ffn" and ndim >= 1:
      return ("experts",) + (None,) * (ndim - 1)
  return (None,) * ndim


def tree_specs(tree, layout: str):
  """PartitionSpec for every leaf of a parameter tree (an `nnx.State`), in the same structure. A leaf below an expert
  weight whose experts axis has size 1 (vq2's per-layer codebook: one for every expert) is replicated."""
  def leaf_spec(path, x):
    logical = param_logical_axes(leaf_path_names(path), x.ndim)
    if x.ndim and logical[0] == "experts" and x.shape[0] == 1:
      logical = (None,) + logical[1:]
    return spec(logical, layout)
  return jax.tree_util.tree_map_with_path(leaf_spec, tree)


def cache_specs(cache, layout: str):
  """PartitionSpec for every leaf of a `KVCache`: the batch axis (leading on every leaf) sharded, rest replicated."""
  batch = RULES[layout]["batch"]
  return jax.tree_util.tree_map(lambda x: P(batch, *(None,) * (x.ndim - 1)), cache)


def devices_along(mesh, axes) -> tuple[tuple[str, ...], int]:
  """A PartitionSpec entry (None, a mesh axis or a tuple of them) -> (its axes as a tuple, the devices they span)."""
  axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
  devices = 1
  for a in axes:
    devices *= mesh.shape[a]
  return axes, devices


def check_divisible(tree, specs, mesh, layout: str) -> None:
  """Raises ValueError naming the first leaf of `tree` whose sharded axis the mesh axes it maps to do not divide
  (before `device_put` fails with a bare IndivisibleError)."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  for (path, x), s in zip(leaves, jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))):
    names = leaf_path_names(path)
    logical = param_logical_axes(names, x.ndim)
    for dim, (size, axes) in enumerate(zip(x.shape, s)):
      axes, devices = devices_along(mesh, axes)
      if size % devices:
        raise ValueError(f"layout={layout!r} splits axis {logical[dim]!r} (size {size}) of {'/'.join(names)} over "
                         f"mesh axes {axes} = {devices} devices, which does not divide it: choose a mesh whose "
                         f"{' x '.join(axes)} divides {size}, or another layout")


def named(mesh, specs):
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
