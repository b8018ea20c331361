"""The gate and up weights of a SwiGLU expert as one int4 weight, for the warp-specialized kernel's fused form.

`int4_grouped_matmul_mgpu_ws(..., swiglu=True)` multiplies x by one [E, Kp, 2F] weight whose columns alternate in
blocks of SWIGLU_BLOCK: 32 columns of gate, the same 32 output columns of up, the next 32 of gate, ... so that a
compute warpgroup's 64 columns hold both operands of 32 output columns of silu(x W_gate) · (x W_up).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import int4_grouped_matmul_mgpu as mg

SWIGLU_BLOCK = 32  # columns of one weight between columns of the other: half a compute warpgroup's 64


def interleave_gate_up(w_gate: mg.MgpuInt4Weights | mg.MgpuInt4WeightsShift,
                       w_up: mg.MgpuInt4Weights | mg.MgpuInt4WeightsShift):
  """Two `to_mgpu_layout` weights [E, Kp, F] (same layout and shapes, F a multiple of 32) -> one [E, Kp, 2F] of
  their layout whose columns go 32 of gate, the same 32 of up, the next 32 of gate, ...: the weight of
  `int4_grouped_matmul_mgpu_ws(..., swiglu=True)`."""
  if type(w_gate) is not type(w_up) or any(a.shape != b.shape for a, b in zip(w_gate, w_up)):
    raise ValueError(f"w_gate and w_up must be the same layout and shapes, got {type(w_gate).__name__} "
                     f"{[a.shape for a in w_gate]} and {type(w_up).__name__} {[a.shape for a in w_up]}")
  f = w_gate.scale.shape[-1]
  if f % SWIGLU_BLOCK:
    raise ValueError(f"F={f} (the weights' N) must be a multiple of {SWIGLU_BLOCK}")

  def mix(g, u, axis):  # interleave blocks of 32 along `axis`
    g, u = jnp.moveaxis(g, axis, -1), jnp.moveaxis(u, axis, -1)
    blocks = g.shape[:-1] + (f // SWIGLU_BLOCK, 1, SWIGLU_BLOCK)
    both = jnp.concatenate([g.reshape(blocks), u.reshape(blocks)], axis=-2)
    return jnp.moveaxis(both.reshape(g.shape[:-1] + (2 * f,)), -1, axis)

  return type(w_gate)(q=mix(w_gate.q, w_up.q, 1), scale=mix(w_gate.scale, w_up.scale, 2),
                      zero=mix(w_gate.zero, w_up.zero, 2))


def split_gate_up(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[..., 2F] in `interleave_gate_up`'s column order (e.g. its dequantized weight) -> (gate, up), [..., F] each."""
  *lead, n = w.shape
  w = w.reshape(*lead, n // (2 * SWIGLU_BLOCK), 2, SWIGLU_BLOCK)
  return w[..., 0, :].reshape(*lead, n // 2), w[..., 1, :].reshape(*lead, n // 2)
