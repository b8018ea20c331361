"""moe-jax: low-latency Mixture-of-Experts decoding in JAX/Flax.

Shape alphabet, used in einsums, `# [B, S, K, H]` comments and sharding names:
  B batch, T query length, S key/value (cache) length, D model dim, N query heads, K kv heads,
  G query heads per kv head (N / K), H head dim, F expert hidden, E experts, X experts per token, V vocab,
  M token-expert pairs (T·X, rows of the grouped expert matmul).

Public names are imported lazily (PEP 562) so that `python -m moe_jax.<module>` runs each CLI module cleanly. The
package itself imports jax and `jax.experimental.pallas.fuser` (through `pallas_kernels`, below: ~0.2 s), so set
jax's environment variables before importing it.
"""

import importlib

# The kernels' package, only its __init__: it completes jax's tracing context before anything here is jitted (see
# `pallas_kernels/__init__.py`; the kernels themselves load lazily, sometimes inside a trace).
import pallas_kernels  # noqa: F401  pylint: disable=unused-import

_EXPORTS = {
    "ModelConfig": "moe_jax.config",
    "Transformer": "moe_jax.model",
    "FlatModel": "moe_jax.flat_model",
    "KVCache": "moe_jax.kv_cache",
    "get_kv_cache_mode": "moe_jax.kv_cache",
    "register_kv_cache_mode": "moe_jax.kv_cache",
    "SamplingParams": "moe_jax.sampling",
    "sample": "moe_jax.sampling",
    "decode_step": "moe_jax.decode",
    "init_model": "moe_jax.decode",
    "logits": "moe_jax.decode",
    "prefill": "moe_jax.decode",
    "validate_prompts": "moe_jax.decode",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'moe_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))  # tab completion lists the lazy exports too
