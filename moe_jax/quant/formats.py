"""The quantized expert weight value: one typed pytree that stands where an [E, K, N] expert weight array stood.

`QuantizedExperts` holds the raw arrays of one format (the kernels' `Int4Weights` / `VQ2Weights`, or
`VQ2SparseWeights`, which has no kernel) plus static metadata. It answers `.dequantize(dtype) -> [E, K, N]` (what the
"xla" grouped matmul does with any non-array weight), `v[...]` (returns itself, so `Variable[...]` reads in the MoE
layer work unchanged), `.shape` and `.nbytes`.

Kinds and bits per weight (G = 128, scales bf16, zero points uint8):
  int4        4 + 24/G        int4 codes, group-wise scale + zero point along K
  int4_sp24   3 + 24/G        2:4 pruned along K quads, 2 int4 codes + a 4-bit keep mask per 4 weights
  vq2         2 + 16/G        8-bit index per 4 weights into 256 bf16 4-vectors, scale per (group, column)
  vq2_sp24    2 + 16/G        2:4 pruned, one 8-bit index per 4 kept values (8 weights) + 4-bit masks: no saving
                              over vq2 with a 4-bit mask (the 6 possible masks would need 2.58 bits); XLA path only.
  int4_mgpu   4 + 32/G        dense int4 (RTN, G = 128) in the layout of the warp-specialized Mosaic GPU kernel
                              (`MgpuInt4WeightsShift`: int4 [E, N, Kp], bf16 scale and zero point), made from an int4
                              value by `quant.to_mgpu_layout`; the "pallas" grouped matmul reads it with that kernel.
  int4_mgpu_gate_up
              4 + 32/G        a layer's gate and up int4_mgpu weights as one [E, K, 2F], columns in blocks of 32: gate,
                              then up (`int4_gate_up_mgpu.interleave_gate_up`); made by `quant.to_mgpu_layout(model,
                              fuse_gate_up=True)` in `w_gate` (`w_up` then holds `moe_jax.experts.FusedIntoGate`);
                              "pallas" / "pallas_fused" read it with one `swiglu=True` call of the same kernel.
  vq2_mgpu    2 + 16/G        dense vq2 (G = 128, no activation scale) in the layout of the Mosaic GPU vq2 kernel
                              (`MgpuVQ2Weights`: the same indices regrouped per lane, the scales, each codebook stored
                              16 times, 32 KB, for conflict-free shared-memory look-ups: + 32 KB per codebook), made
                              from a vq2 value by `quant.to_mgpu_layout`; "pallas" / "pallas_fused" read it with that
                              kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.int4_gate_up_mgpu import split_gate_up
from pallas_kernels.int4_grouped_matmul import Int4Weights, dequantize_int4
from pallas_kernels.int4_grouped_matmul_mgpu import MgpuInt4WeightsShift, dequantize_mgpu
from pallas_kernels.vq2_grouped_matmul import VQ2Weights, dequantize_vq2, unpack_codebook
from pallas_kernels.vq2_grouped_matmul_mgpu_ws import MgpuVQ2Weights
from pallas_kernels.vq2_grouped_matmul_mgpu_ws import dequantize_mgpu as dequantize_vq2_mgpu

KINDS = ("int4", "int4_sp24", "vq2", "vq2_sp24", "int4_mgpu", "int4_mgpu_gate_up", "vq2_mgpu")
MGPU_KINDS = ("int4_mgpu", "int4_mgpu_gate_up", "vq2_mgpu")  # `quant.to_mgpu_layout`'s kinds (not saved)


class VQ2SparseWeights(NamedTuple):
  """vq2 over 2:4-pruned weights: K group g splits into G/4 quads (quad r: k = g·G + r + (G/4)·j); quads r and
  r + G/8 keep two values each, and those four values form one vector.

  idx uint8 [E, Kp/8, N] (row g·G/8 + r'), meta uint8 [E, Kp/8, N] (keep masks of quads r' (low) and r' + G/8
  (high)), codebook uint32 [C, 2, 256], scale [E, Kp/G, N], in_scale f32 [E, Kp] or None.
  """
  idx: jax.Array
  meta: jax.Array
  codebook: jax.Array
  scale: jax.Array
  in_scale: jax.Array | None = None


def expand_sparse(vals: jax.Array, mask: jax.Array, fill) -> jax.Array:
  """Places the two kept values of each quad at their slots.

  Args:
    vals: [..., G/4, N, 2] the first and second kept value of each quad.
    mask: int [..., G/4, N] 4-bit keep masks.
    fill: value of pruned slots (broadcastable to [..., G/4, N]).

  Returns:
    [..., G, N] with slot j of quad r at r + (G/4)·j.
  """
  v0, v1 = vals[..., 0], vals[..., 1]
  b = [((mask >> j) & 1) == 1 for j in range(4)]
  w = [jnp.where(b[0], v0, fill), jnp.where(b[1], jnp.where(b[0], v1, v0), fill),
       jnp.where(b[2], jnp.where(b[0] | b[1], v1, v0), fill), jnp.where(b[3], v1, fill)]
  return jnp.concatenate(w, axis=-2)


def _dequantize_vq2_sparse(ws: VQ2SparseWeights, group_size: int) -> jax.Array:
  e, rows, n = ws.idx.shape
  ng, eighth = ws.scale.shape[1], group_size // 8
  cb = jnp.broadcast_to(unpack_codebook(ws.codebook), (e, 256, 4))
  vec = jax.vmap(lambda c, i: c[i])(cb, ws.idx.astype(jnp.int32)).reshape(e, ng, eighth, n, 4)
  # Vector coordinates (0, 1) are quad r''s kept values, (2, 3) those of quad r' + G/8.
  vals = jnp.concatenate([vec[..., 0:2], vec[..., 2:4]], axis=2)  # [E, Kg, G/4, N, 2]
  m = ws.meta.astype(jnp.int32).reshape(e, ng, eighth, n)
  mask = jnp.concatenate([m & 15, m >> 4], axis=2)  # [E, Kg, G/4, N]
  w = expand_sparse(vals, mask, 0.0) * ws.scale.astype(jnp.float32)[:, :, None, :]
  w = w.reshape(e, ng * group_size, n)
  if ws.in_scale is not None:
    w = w * ws.in_scale.astype(jnp.float32)[:, :, None]
  return w


@struct.dataclass
class QuantizedExperts:
  """A quantized [E, K, N] expert weight.

  Attributes:
    data: the format's raw arrays (Int4Weights, VQ2Weights, VQ2SparseWeights, MgpuInt4WeightsShift or
      MgpuVQ2Weights).
    kind: one of KINDS.
    k: the logical K (the arrays hold Kp >= k, zero-padded to a multiple of group_size).
    group_size: G, the K group of scales (and of the kernels' layout).
    options: keyword arguments of the kind's kernel as sorted (name, value) pairs (static; MGPU_KINDS only, set by
      `quant.to_mgpu_layout(model, block_r=...)`); () for its defaults.
  """
  data: Int4Weights | VQ2Weights | VQ2SparseWeights | MgpuInt4WeightsShift | MgpuVQ2Weights
  kind: str = struct.field(pytree_node=False)
  k: int = struct.field(pytree_node=False)
  group_size: int = struct.field(pytree_node=False)
  options: tuple[tuple[str, object], ...] = struct.field(pytree_node=False, default=())

  def __getitem__(self, idx):
    if idx is Ellipsis:
      return self
    raise TypeError(f"a QuantizedExperts value supports only [...], not [{idx!r}]; use .dequantize()")

  @property
  def kp(self) -> int:
    return self.data.scale.shape[1] * self.group_size

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.data.scale.shape[0], self.k, self.data.scale.shape[2])

  @property
  def nbytes(self) -> int:
    # int4 arrays report 1 byte per element (ml_dtypes) but are stored packed, two per byte.
    return sum(int(x.size) // 2 if x.dtype == jnp.int4 else int(x.size) * x.dtype.itemsize
               for x in jax.tree.leaves(self.data))

  def bits_per_weight(self) -> float:
    e, k, n = self.shape
    return 8.0 * self.nbytes / (e * k * n)

  @functools.partial(jax.jit, static_argnames=("dtype",))
  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """[E, K, N] in dtype: the weight the kernels multiply by (padding rows dropped). For int4_mgpu_gate_up that is
    the interleaved [E, K, 2F] (`dequantize_gate_up` separates gate and up)."""
    if self.kind in ("int4", "int4_sp24"):
      w = dequantize_int4(self.data, group_size=self.group_size)
    elif self.kind == "vq2":
      w = dequantize_vq2(self.data, group_size=self.group_size)
    elif self.kind in ("int4_mgpu", "int4_mgpu_gate_up"):
      w = dequantize_mgpu(self.data)
    elif self.kind == "vq2_mgpu":
      w = dequantize_vq2_mgpu(self.data)
    else:
      w = _dequantize_vq2_sparse(self.data, self.group_size)
    return w[:, : self.k].astype(dtype)

  @functools.partial(jax.jit, static_argnames=("dtype",))
  def dequantize_gate_up(self, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(gate, up), [E, K, F] each in dtype, of an int4_mgpu_gate_up weight: the values of the two int4_mgpu weights
    it was made from."""
    if self.kind != "int4_mgpu_gate_up":
      raise ValueError(f"dequantize_gate_up takes kind 'int4_mgpu_gate_up', not {self.kind!r}")
    return split_gate_up(self.dequantize(dtype))
