"""The routed experts' computation: a SwiGLU over tokens grouped by expert, through a grouped matmul.

`grouped_matmul` keeps the `jax.lax.ragged_dot` contract (lhs [M, K] sorted by group, rhs [E, K, N],
group_sizes [E]) and picks an implementation: "xla" (`ragged_dot`) always works; kernels of `pallas_kernels/` and
quantized weight formats register themselves in `GROUPED_MATMULS` under their own names.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# name -> fn(lhs [M, K], rhs [E, K, N] (array or quantized value), group_sizes [E]) -> [M, N]
GROUPED_MATMULS: dict[str, Callable[..., jax.Array]] = {}
# name -> fn(x_sorted [M, D], w_gate, w_up, group_sizes [E]) -> silu(x W_gate) * (x W_up) [M, F]: fused kernels.
FUSED_SWIGLU: dict[str, Callable[..., jax.Array]] = {}


def _ragged_dot_xla(lhs: jax.Array, rhs, group_sizes: jax.Array) -> jax.Array:
  if not isinstance(rhs, jax.Array):
    rhs = rhs.dequantize(lhs.dtype)  # a quantized weight value: the XLA fallback dequantizes, then multiplies.
  return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32)


GROUPED_MATMULS["xla"] = _ragged_dot_xla


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
    w_gate, w_up: [E, D, F]; w_down: [E, F, D] (arrays or quantized values).
    implementation: a key of `GROUPED_MATMULS`.

  Returns:
    [M, D] in x_sorted's dtype.
  """
  if implementation in FUSED_SWIGLU:
    h = FUSED_SWIGLU[implementation](x_sorted, w_gate, w_up, group_sizes).astype(x_sorted.dtype)  # [M, F]
  else:
    gate = grouped_matmul(x_sorted, w_gate, group_sizes, implementation=implementation)
    up = grouped_matmul(x_sorted, w_up, group_sizes, implementation=implementation)
    h = (jax.nn.silu(gate) * up).astype(x_sorted.dtype)  # [M, F]
  return grouped_matmul(h, w_down, group_sizes, implementation=implementation).astype(x_sorted.dtype)
