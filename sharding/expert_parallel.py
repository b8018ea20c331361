"""Expert-parallel MoE dispatch inside `shard_map`: experts split over ("node", "local"), tokens moved by all-to-all.

`ExpertParallelDispatch` has the call signature of `moe_jax.dispatch.LocalDispatch`, and runs inside a `shard_map`
over the ("node", "local") mesh (`sharding/runner.py` wraps the whole step), where the MoE layer's expert weights are
this device's block of E_loc = E / (n_nodes · n_local) experts and x holds this device's T tokens. Expert e lives on
device e // E_loc (node-major), the same contiguous placement `moe_jax.locality` assumes.

Steps (per device): each token-expert pair goes to its expert's device (dispatch all-to-all), the device runs its
experts over the rows it received (grouped matmul), the results go back (combine all-to-all), and each token sums
its X results weighted by the combine weights.

Transports:
  * "padded" (works everywhere, CPU CI included): a [P, C, D] buffer per device, C rows per (source, destination).
    The default C is the worst case T · min(X, E_loc) (a token sends at most min(X, E_loc) pairs to one device),
    so nothing is ever dropped. A smaller `capacity` is allowed for measurement; a pair that does not fit is counted
    by `capacity_overflow` and its token's output is set to NaN, never silently dropped.
  * "ragged": `jax.lax.ragged_all_to_all` moves exactly the rows needed (GPU; XLA:CPU does not implement it).
  * "ragged_emulated": the same ragged algorithm with the collective emulated by a padded all-to-all, so that CI on
    CPU tests the ragged bookkeeping (offsets and sizes) that the GPU runs.

`node_local=True` (decode with LCVC surrogates): only pairs whose expert is on the token's own node move, through an
all-to-all over "local" alone, so the compiled step has no collective across "node"; remote pairs contribute zero
(the LCVC layer computes them with surrogates and zeroes their weights here).

Shapes: T tokens on this device, D model dim, X experts per token, M = T·X pairs, E experts, P devices in the
all-to-all group, C capacity rows per (source, destination), R = P·C received rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.dispatch import ExpertFn, combine
from sharding.meshes import LOCAL, NODE

TRANSPORTS = ("padded", "ragged", "ragged_emulated")


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, max_rows: int):
  """`jax.lax.ragged_all_to_all` semantics (one slice per peer) built from a padded all-to-all.

  Args:
    operand: [M, ...] rows to send; input_offsets, send_sizes, output_offsets, recv_sizes: int32 [P].
    output: [R, ...] buffer the received rows are written into.
    max_rows: static bound on every send size.
  """
  p = send_sizes.shape[0]
  i = jnp.arange(max_rows, dtype=jnp.int32)
  idx = input_offsets[:, None] + i[None, :]  # [P, max_rows]
  chunks = jnp.take(operand, jnp.clip(idx, 0, operand.shape[0] - 1).reshape(-1), axis=0)
  chunks = chunks.reshape((p, max_rows) + operand.shape[1:])
  received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [P, max_rows, ...] from each source
  where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source writes here
  dst = where[:, None] + i[None, :]
  dst = jnp.where(i[None, :] < recv_sizes[:, None], dst, output.shape[0])  # out of range: dropped by the scatter
  return output.at[dst.reshape(-1)].set(received.reshape((-1,) + operand.shape[1:]), mode="drop")


@dataclasses.dataclass(frozen=True)
class ExpertParallelDispatch:
  """Experts split over ("node", "local"); call inside a `shard_map` over both axes.

  Attributes:
    n_nodes, n_local: mesh sizes.
    node_local: move only pairs whose expert is on this node, over "local" (decode with surrogates).
    transport: "padded", "ragged" or "ragged_emulated".
    capacity: rows per (source, destination) of the padded buffers; None = the dropless worst case.
  """

  n_nodes: int
  n_local: int
  node_local: bool = False
  transport: str = "padded"
  capacity: int | None = None

  def __post_init__(self):
    if self.transport not in TRANSPORTS:
      raise ValueError(f"transport={self.transport!r} must be one of {TRANSPORTS}")
    if self.capacity is not None and (not isinstance(self.capacity, int) or isinstance(self.capacity, bool)
                                      or self.capacity < 1):
      raise ValueError(f"capacity={self.capacity!r} must be an int >= 1 or None")
    if self.capacity is not None and self.transport != "padded":  # before: ignored (the ragged ones are dropless)
      raise ValueError(f"capacity={self.capacity!r} sizes the padded transport's buffers; transport="
                       f"{self.transport!r} sends exactly the rows it has (leave capacity=None)")

  @property
  def group_axes(self):
    return LOCAL if self.node_local else (NODE, LOCAL)

  @property
  def group_size(self) -> int:
    return self.n_local if self.node_local else self.n_nodes * self.n_local

  def experts_per_device(self, n_experts: int) -> int:
    p = self.n_nodes * self.n_local
    if n_experts % p:
      raise ValueError(f"n_experts={n_experts} must be divisible by the {p} devices of the mesh")
    return n_experts // p

  def token_nodes(self, n_tokens: int) -> jax.Array:
    """int32 [T]: every token on this device is on this device's node."""
    return jnp.full((n_tokens,), jax.lax.axis_index(NODE), jnp.int32)

  def worst_case_capacity(self, n_tokens: int, k: int, n_experts: int) -> int:
    return n_tokens * min(k, self.experts_per_device(n_experts))

  def routes(self, ids: jax.Array, n_experts: int):
    """Destination of every pair: (dest int32 [M] in the group, valid bool [M], local expert int32 [M])."""
    e_loc = self.experts_per_device(n_experts)
    flat = ids.reshape(-1)
    device = flat // e_loc  # node-major device index
    if self.node_local:
      valid = device // self.n_local == jax.lax.axis_index(NODE)
      dest = device % self.n_local
    else:
      valid = jnp.ones(flat.shape, bool)
      dest = device
    return dest.astype(jnp.int32), valid, (flat % e_loc).astype(jnp.int32)

  def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array, expert_fn: ExpertFn,
               n_experts: int) -> jax.Array:
    """x: [T, D] this device's tokens, weights: [T, X], ids: [T, X] global expert ids -> [T, D]."""
    t, k = ids.shape
    dest, valid, local_expert = self.routes(ids, n_experts)
    rows = jnp.take(x, jnp.arange(t * k) // k, axis=0)  # [M, D] the token of every pair
    if self.transport == "padded":
      y = self._padded(rows, dest, valid, local_expert, expert_fn, n_experts, t, k)
    else:
      y = self._ragged(rows, dest, valid, local_expert, expert_fn, n_experts, t, k)
    return combine(y.reshape(t, k, -1), weights)

  def _run_experts(self, rows: jax.Array, local_expert: jax.Array, expert_fn: ExpertFn, e_loc: int) -> jax.Array:
    """Received rows [R, D] with local expert ids [R] (e_loc marks an empty row) -> [R, D], empty rows 0."""
    order = jnp.argsort(local_expert, stable=True)
    group_sizes = jnp.sum(local_expert[:, None] == jnp.arange(e_loc)[None, :], axis=0).astype(jnp.int32)
    y_sorted = expert_fn(jnp.take(rows, order, axis=0), group_sizes)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    return jnp.where((local_expert < e_loc)[:, None], y, 0)

  def _padded(self, rows, dest, valid, local_expert, expert_fn, n_experts, t, k):
    p, e_loc = self.group_size, self.experts_per_device(n_experts)
    c = self.capacity or self.worst_case_capacity(t, k, n_experts)
    one_hot = (dest[:, None] == jnp.arange(p)[None, :]) & valid[:, None]  # [M, P]
    pos = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1  # rank of the pair at its destination
    keep = valid & (pos < c)
    overflow = valid & (pos >= c)
    slot = jnp.where(keep, dest * c + pos, p * c)  # p * c: a scratch row, sliced off
    d = rows.shape[-1]
    send = jnp.zeros((p * c + 1, d), rows.dtype).at[slot].set(rows)[: p * c].reshape(p, c, d)
    send_e = jnp.full((p * c + 1,), e_loc, jnp.int32).at[slot].set(local_expert)[: p * c].reshape(p, c)
    recv = jax.lax.all_to_all(send, self.group_axes, 0, 0, tiled=True)  # [P, C, D] by source
    recv_e = jax.lax.all_to_all(send_e, self.group_axes, 0, 0, tiled=True)  # [P, C]
    y = self._run_experts(recv.reshape(p * c, d), recv_e.reshape(-1), expert_fn, e_loc)
    back = jax.lax.all_to_all(y.reshape(p, c, d), self.group_axes, 0, 0, tiled=True).reshape(p * c, d)
    y_pairs = jnp.where(keep[:, None], jnp.take(back, jnp.minimum(slot, p * c - 1), axis=0), 0)
    return jnp.where(overflow[:, None], jnp.nan, y_pairs)  # a dropped pair poisons its token: never silent

  def _ragged(self, rows, dest, valid, local_expert, expert_fn, n_experts, t, k):
    p, e_loc = self.group_size, self.experts_per_device(n_experts)
    m, d = rows.shape
    key = jnp.where(valid, dest, p)
    order = jnp.argsort(key, stable=True)  # pairs grouped by destination, invalid last
    send_sizes = jnp.sum((dest[:, None] == jnp.arange(p)[None, :]) & valid[:, None], axis=0).astype(jnp.int32)
    sizes = jax.lax.all_gather(send_sizes, self.group_axes, tiled=False).reshape(p, p)  # [source, destination]
    me = jax.lax.axis_index(self.group_axes)
    input_offsets = _exclusive_cumsum(send_sizes)
    output_offsets = _exclusive_cumsum(sizes, axis=0)[me]  # where my rows land on each destination
    recv_sizes = sizes[:, me]
    r = p * self.worst_case_capacity(t, k, n_experts)
    if self.transport == "ragged":
      a2a = jax.lax.ragged_all_to_all
    else:
      def a2a(*args, axis_name):
        return ragged_all_to_all_emulated(*args, axis_name=axis_name, max_rows=m)
    operand = jnp.take(rows, order, axis=0)
    operand_e = jnp.take(local_expert, order)[:, None]
    recv = a2a(operand, jnp.zeros((r, d), rows.dtype), input_offsets, send_sizes, output_offsets, recv_sizes,
               axis_name=self.group_axes)
    recv_e = a2a(operand_e, jnp.full((r, 1), e_loc, jnp.int32), input_offsets, send_sizes, output_offsets,
                 recv_sizes, axis_name=self.group_axes)
    y = self._run_experts(recv, recv_e[:, 0], expert_fn, e_loc)
    # Back: the rows from source s sit at recv_offsets[s]; they return to where s took them from.
    back_out_offsets = _exclusive_cumsum(sizes, axis=1)[:, me]
    back = a2a(y, jnp.zeros((m, d), y.dtype), _exclusive_cumsum(recv_sizes), recv_sizes, back_out_offsets,
               send_sizes, axis_name=self.group_axes)
    y_pairs = jnp.zeros((m, d), y.dtype).at[order].set(back, unique_indices=True)
    return jnp.where(valid[:, None], y_pairs, 0)


def capacity_overflow(ids: jax.Array, *, n_experts: int, n_devices: int, capacity: int,
                      node: int | None = None, n_nodes: int = 1) -> jax.Array:
  """Pairs a padded dispatch with `capacity` rows per (source, destination) could not place, for ids of one
  source device [T, X] (global view; no mesh needed). 0 means the capacity was enough.

  A node-local dispatch (`node_local=True`, decode with surrogates) sends only the pairs whose expert is on the
  source's node: pass that `node` and the mesh's `n_nodes` to count only those (the others go to surrogates)."""
  dest = ids.reshape(-1) // (n_experts // n_devices)
  counts = jnp.bincount(dest, length=n_devices)
  if node is not None:
    if n_devices % n_nodes or not 0 <= node < n_nodes:
      raise ValueError(f"node={node} must be in [0, n_nodes={n_nodes}) and n_nodes must divide n_devices={n_devices}")
    counts = jnp.where(jnp.arange(n_devices) // (n_devices // n_nodes) == node, counts, 0)
  return jnp.sum(jnp.maximum(counts - capacity, 0))
