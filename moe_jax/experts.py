"""The routed experts' computation: a SwiGLU over tokens grouped by expert, through a grouped matmul.

`grouped_matmul` keeps the `jax.lax.ragged_dot` contract (lhs [M, K] sorted by group, rhs [E, K, N],
group_sizes [E]) and picks an implementation: "xla" (`ragged_dot`) always works; kernels of `pallas_kernels/` and
quantized weight formats register themselves in `GROUPED_MATMULS` under their own names.

A layer may store gate and up as one weight value (`quant.to_mgpu_layout(model, fuse_gate_up=True)`): `w_gate` then
holds both and `w_up` holds `FusedIntoGate`, and `swiglu_experts` computes silu(x W_gate) · (x W_up) from `w_gate`
alone through `GATE_UP_SWIGLU`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

# name -> fn(lhs [M, K], rhs [E, K, N] (array or quantized value), group_sizes [E]) -> [M, N]
GROUPED_MATMULS: dict[str, Callable[..., jax.Array]] = {}
# name -> fn(x_sorted [M, D], w_gate, w_up, group_sizes [E]) -> silu(x W_gate) * (x W_up) [M, F]: fused kernels.
FUSED_SWIGLU: dict[str, Callable[..., jax.Array]] = {}
# name -> fn(x_sorted [M, D], w_gate_up, group_sizes [E]) -> silu(x W_gate) * (x W_up) float32 [M, F], for a weight
# value that holds gate and up (its `dequantize_gate_up(dtype)` -> two [E, D, F] arrays).
GATE_UP_SWIGLU: dict[str, Callable[..., jax.Array]] = {}


@struct.dataclass
class FusedIntoGate:
  """The value of a layer's `w_up` when its `w_gate` holds gate and up in one weight: no arrays, zero bytes.

  Attributes:
    shape: the up weight's logical [E, D, F].
  """
  shape: tuple[int, int, int] = struct.field(pytree_node=False)
  nbytes = 0

  def __getitem__(self, idx):
    if idx is Ellipsis:  # `Variable[...]` reads, as for a quantized value
      return self
    raise TypeError(f"w_up is fused into w_gate and supports only [...], not [{idx!r}]")

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    del dtype
    raise ValueError("w_up is fused into w_gate (quant.to_mgpu_layout(..., fuse_gate_up=True)): read both weights "
                     "from w_gate.dequantize_gate_up()")


def _ragged_dot_xla(lhs: jax.Array, rhs, group_sizes: jax.Array) -> jax.Array:
  if not isinstance(rhs, jax.Array):
    rhs = rhs.dequantize(lhs.dtype)  # a quantized weight value: the XLA fallback dequantizes, then multiplies.
  return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32)


def _gate_up_swiglu_xla(x_sorted: jax.Array, w_gate_up, group_sizes: jax.Array) -> jax.Array:
  gate, up = w_gate_up.dequantize_gate_up(x_sorted.dtype)  # [E, D, F] each, the unfused weights' values
  return jax.nn.silu(_ragged_dot_xla(x_sorted, gate, group_sizes)) * _ragged_dot_xla(x_sorted, up, group_sizes)


GROUPED_MATMULS["xla"] = _ragged_dot_xla
GATE_UP_SWIGLU["xla"] = _gate_up_swiglu_xla


def grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array, *, implementation: str = "xla") -> jax.Array:
  """lhs: [M, K] rows sorted by group; rhs: [E, K, N]; group_sizes: int32 [E] -> float32 [M, N]."""
  if implementation not in GROUPED_MATMULS:
    raise ValueError(f"implementation={implementation!r} is not a grouped matmul; choose one of "
                     f"{sorted(GROUPED_MATMULS)}")
  return GROUPED_MATMULS[implementation](lhs, rhs, group_sizes)


def swiglu_experts(x_sorted: jax.Array, group_sizes: jax.Array, w_gate, w_up, w_down, *,
                   implementation: str = "xla") -> jax.Array:
  """Routed SwiGLU experts over grouped rows.

  Args:
    x_sorted: [M, D] rows sorted by expert.
    group_sizes: int32 [E].
    w_gate, w_up: [E, D, F]; w_down: [E, F, D] (arrays or quantized values). Or w_gate one value holding gate and
      up (e.g. kind "int4_mgpu_gate_up") and w_up `FusedIntoGate`: then `GATE_UP_SWIGLU[implementation]` runs.
    implementation: a key of `GROUPED_MATMULS`.

  Returns:
    [M, D] in x_sorted's dtype.
  """
  if isinstance(w_up, FusedIntoGate):
    if implementation not in GATE_UP_SWIGLU:
      raise ValueError(f"implementation={implementation!r} has no route for gate and up fused into w_gate; choose "
                       f"one of {sorted(GATE_UP_SWIGLU)}")
    h = GATE_UP_SWIGLU[implementation](x_sorted, w_gate, group_sizes).astype(x_sorted.dtype)  # [M, F]
  elif implementation in FUSED_SWIGLU:
    h = FUSED_SWIGLU[implementation](x_sorted, w_gate, w_up, group_sizes).astype(x_sorted.dtype)  # [M, F]
  else:
    gate = grouped_matmul(x_sorted, w_gate, group_sizes, implementation=implementation)
    up = grouped_matmul(x_sorted, w_up, group_sizes, implementation=implementation)
    h = (jax.nn.silu(gate) * up).astype(x_sorted.dtype)  # [M, F]
  return grouped_matmul(h, w_down, group_sizes, implementation=implementation).astype(x_sorted.dtype)
