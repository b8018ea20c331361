"""The Pallas grouped-matmul implementations for quantized experts, registered on import.

  GROUPED_MATMULS["pallas"]        int4 / int4_sp24 / vq2 weights through the dequant-fused Triton kernels of
                                   `pallas_kernels/`, int4_mgpu weights (`quant.to_mgpu_layout`) through the
                                   warp-specialized Mosaic GPU kernel (lhs rounded to bf16; with the weights'
                                   kernel options, `QuantizedExperts.options`), vq2_mgpu weights through the
                                   Mosaic GPU vq2 kernel (the same way); any other weight (bf16 arrays,
                                   vq2_sp24) falls back to "xla".
  GROUPED_MATMULS["pallas_fused"]  the same per matmul, and `FUSED_SWIGLU["pallas_fused"]` computes
                                   silu(x W_gate) · (x W_up) in one kernel (one pass over the rows, both weights
                                   streamed by the same program).
  GATE_UP_SWIGLU["pallas"], ["pallas_fused"]
                                   gate and up stored as one int4_mgpu_gate_up weight (`quant.to_mgpu_layout(model,
                                   fuse_gate_up=True)`): one `swiglu=True` call of the warp-specialized Mosaic GPU
                                   kernel; any other value through the "xla" route.

On a backend other than GPU the kernels run in Pallas interpret mode (slow, exact): what the CPU tests exercise.
Gradients through any of them are their XLA references' (`with_reference_gradient`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from moe_jax import backend
from moe_jax import experts as experts_lib
from moe_jax.quant.formats import QuantizedExperts
from pallas_kernels import hopper
from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import int4_grouped_matmul_mgpu_ws as mws
from pallas_kernels import vq2_grouped_matmul as v2
from pallas_kernels import vq2_grouped_matmul_mgpu_ws as vmws

TRITON_KINDS = ("int4", "int4_sp24", "vq2")  # through the Triton kernels: N a multiple of 16 (pick_block_n)
KERNEL_KINDS = TRITON_KINDS + ("int4_mgpu", "vq2_mgpu")
FUSED_KINDS = ("int4", "int4_sp24", "vq2")  # formats with a fused gate/up + SwiGLU kernel


def _pad_lhs(lhs: jax.Array, kp: int) -> jax.Array:
  return lhs if lhs.shape[1] == kp else jnp.pad(lhs, ((0, 0), (0, kp - lhs.shape[1])))


def _check_operands(lhs: jax.Array, w: QuantizedExperts, group_sizes: jax.Array) -> None:
  """ValueError naming an lhs whose K is not the weight's (the kernels zero-pad lhs to the weight's stored Kp, so a
  wrong K was padded, not refused) and non-integer group_sizes (the kernels' int32 cast truncated them)."""
  if lhs.ndim != 2 or lhs.shape[1] != w.shape[1]:
    raise ValueError(f"lhs {tuple(lhs.shape)} must be [M, K = {w.shape[1]}] for the expert weight {tuple(w.shape)}")
  dtype = jnp.result_type(group_sizes)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integers, got dtype {dtype}")


def _check_mosaic_gpu(kind: str) -> None:
  if not hopper.mosaic_gpu_runs():
    raise ValueError(f"experts of kind {kind!r} (quant.to_mgpu_layout) run through a Mosaic GPU kernel that needs "
                     f"a Hopper GPU (compute capability 9.x); this device is {jax.devices()[0].device_kind}. Keep "
                     "the 'int4' layout there, or quant.set_implementation(model, 'xla')")


def _ws_call(lhs: jax.Array, w: QuantizedExperts, group_sizes: jax.Array, **kw) -> jax.Array:
  """The warp-specialized Mosaic GPU kernel of a to_mgpu_layout weight (int4 or vq2): lhs padded to its Kp and rounded
  to bf16 (the kernels' contract), the weight's stored kernel options; refuses where Mosaic GPU does not run."""
  _check_mosaic_gpu(w.kind)
  _check_operands(lhs, w, group_sizes)
  x = _pad_lhs(lhs, w.kp).astype(jnp.bfloat16)
  fn = vmws.vq2_grouped_matmul_mgpu_ws if w.kind == "vq2_mgpu" else mws.int4_grouped_matmul_mgpu_ws
  return fn(x, w.data, group_sizes.astype(jnp.int32), interpret=backend.interpret_kernels(), **dict(w.options), **kw)


def pallas_grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array) -> jax.Array:
  """lhs [M, K] sorted by expert, rhs [E, K, N] (QuantizedExperts), group_sizes int32 [E] -> float32 [M, N]."""
  if not isinstance(rhs, QuantizedExperts) or rhs.kind not in KERNEL_KINDS:
    return experts_lib.GROUPED_MATMULS["xla"](lhs, rhs, group_sizes)
  if rhs.kind in ("int4_mgpu", "vq2_mgpu") and lhs.shape[0]:
    return _ws_call(lhs, rhs, group_sizes)  # the GPU checked first, then the operands
  _check_operands(lhs, rhs, group_sizes)
  if lhs.shape[0] == 0:  # no rows (as ragged_dot allows): no kernel to launch
    return jnp.zeros((0, rhs.shape[-1]), jnp.float32)
  x = _pad_lhs(lhs, rhs.kp)
  fn = v2.vq2_grouped_matmul if rhs.kind == "vq2" else i4.int4_grouped_matmul
  return fn(x, rhs.data, group_sizes.astype(jnp.int32), group_size=rhs.group_size,
            interpret=backend.interpret_kernels())


def pallas_fused_swiglu(x_sorted: jax.Array, w_gate, w_up, group_sizes: jax.Array) -> jax.Array:
  """silu(x W_gate) · (x W_up) -> [M, F] in x_sorted's dtype, one kernel when both weights share a kernel format."""
  same = (isinstance(w_gate, QuantizedExperts) and isinstance(w_up, QuantizedExperts)
          and w_gate.kind == w_up.kind and w_gate.kind in FUSED_KINDS and w_gate.group_size == w_up.group_size)
  if not same:
    g = pallas_grouped_matmul(x_sorted, w_gate, group_sizes)
    u = pallas_grouped_matmul(x_sorted, w_up, group_sizes)
    return (jax.nn.silu(g) * u).astype(x_sorted.dtype)
  _check_operands(x_sorted, w_gate, group_sizes)
  x = _pad_lhs(x_sorted, w_gate.kp)
  fn = v2.vq2_grouped_swiglu if w_gate.kind == "vq2" else i4.int4_grouped_swiglu
  return fn(x, w_gate.data, w_up.data, group_sizes.astype(jnp.int32), group_size=w_gate.group_size,
            interpret=backend.interpret_kernels())


def pallas_gate_up_swiglu(x_sorted: jax.Array, w_gate_up, group_sizes: jax.Array) -> jax.Array:
  """x_sorted [M, D] sorted by expert, w_gate_up gate and up in one weight [E, D, 2F] (kind int4_mgpu_gate_up),
  group_sizes int32 [E] -> silu(x W_gate) · (x W_up) float32 [M, F]: one call of the warp-specialized kernel (lhs
  rounded to bf16, with the weight's kernel options)."""
  if not isinstance(w_gate_up, QuantizedExperts) or w_gate_up.kind != "int4_mgpu_gate_up":
    return experts_lib.GATE_UP_SWIGLU["xla"](x_sorted, w_gate_up, group_sizes)
  return _ws_call(x_sorted, w_gate_up, group_sizes, swiglu=True)


def with_reference_gradient(kernel: Callable[..., jax.Array], reference: Callable[..., jax.Array]):
  """`kernel` forward, `reference`'s vector-Jacobian product backward (recomputed from the same arguments).

  Pallas calls have no autodiff rule of their own (grad through one stopped in an AssertionError inside jax); the
  kernels compute what their XLA references compute, so the references' gradients are theirs (for the lhs and any
  float leaves of the weights; integer codes get float0). A forward-only call costs nothing extra.
  """
  @jax.custom_vjp
  def call(*args):
    return kernel(*args)

  def fwd(*args):
    return kernel(*args), args

  def bwd(args, g):
    out, vjp = jax.vjp(reference, *args)
    return vjp(g.astype(out.dtype))

  call.defvjp(fwd, bwd)
  return functools.wraps(kernel)(call)


def _swiglu_reference(x_sorted: jax.Array, w_gate, w_up, group_sizes: jax.Array) -> jax.Array:
  g = experts_lib.GROUPED_MATMULS["xla"](x_sorted, w_gate, group_sizes)
  u = experts_lib.GROUPED_MATMULS["xla"](x_sorted, w_up, group_sizes)
  return (jax.nn.silu(g) * u).astype(x_sorted.dtype)


grouped_matmul_kernel = with_reference_gradient(pallas_grouped_matmul, experts_lib.GROUPED_MATMULS["xla"])
fused_swiglu_kernel = with_reference_gradient(pallas_fused_swiglu, _swiglu_reference)
gate_up_swiglu_kernel = with_reference_gradient(pallas_gate_up_swiglu, experts_lib.GATE_UP_SWIGLU["xla"])
experts_lib.GROUPED_MATMULS["pallas"] = grouped_matmul_kernel
experts_lib.GROUPED_MATMULS["pallas_fused"] = grouped_matmul_kernel
experts_lib.FUSED_SWIGLU["pallas_fused"] = fused_swiglu_kernel
experts_lib.GATE_UP_SWIGLU["pallas"] = gate_up_swiglu_kernel
experts_lib.GATE_UP_SWIGLU["pallas_fused"] = gate_up_swiglu_kernel
