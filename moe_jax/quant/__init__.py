"""Quantized, micro-sparse routed experts: int4 (RTN / AWQ), vq2, 2:4 sparsity, Pallas kernels, orbax I/O.

Importing this package registers the "pallas" and "pallas_fused" grouped matmuls (`moe_jax.experts`) and, when the
evaluation harness exists, the expert quantization modes of `moe_jax.eval.EXPERT_QUANT_MODES`.
"""

from moe_jax.quant import kernels as _kernels  # noqa: F401  (registers the Pallas grouped matmuls)
from moe_jax.quant.experts import (MODES, QuantSpec, collect_expert_inputs, default_calibration_tokens,
                                   expert_bytes, expert_weights, parse_kernel_options, quantize_experts,
                                   quantize_weight, set_implementation, spec_for, to_mgpu_layout)
from moe_jax.quant.formats import KINDS, QuantizedExperts
from moe_jax.quant.int4 import quantize_int4
from moe_jax.quant.io import load_quantized, save_quantized
from moe_jax.quant.vq2 import quantize_vq2

__all__ = [
    "KINDS", "MODES", "QuantSpec", "QuantizedExperts", "collect_expert_inputs", "default_calibration_tokens",
    "expert_bytes", "expert_weights", "load_quantized", "parse_kernel_options", "quantize_experts", "quantize_int4",
    "quantize_vq2", "quantize_weight", "save_quantized", "set_implementation", "spec_for", "to_mgpu_layout",
]


def _register_eval_modes():
  try:
    from moe_jax import eval as eval_lib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  for name in ("int4", "int4_awq", "vq2", "vq2_awq", "int4_sp24", "vq2_sp24", "int4_awq_sp24"):
    eval_lib.EXPERT_QUANT_MODES.setdefault(name, lambda model, _n=name: quantize_experts(model, _n))


_register_eval_modes()
