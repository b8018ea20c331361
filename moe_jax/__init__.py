"""moe-jax: low-latency Mixture-of-Experts decoding in JAX/Flax.

Shape alphabet, used in einsums, `# [B, S, K, H]` comments and sharding names:
  B batch, T query length, S key/value (cache) length, D model dim, N query heads, K kv heads,
  G query heads per kv head (N / K), H head dim, F expert hidden, E experts, X experts per token, V vocab,
  M token-expert pairs (T·X, rows of the grouped expert matmul).
"""

from moe_jax.config import ModelConfig
from moe_jax.decode import decode_step, init_model, logits, prefill, validate_prompts
from moe_jax.kv_cache import KVCache, get_kv_cache_mode, register_kv_cache_mode
from moe_jax.model import Transformer
from moe_jax.sampling import SamplingParams, sample

__all__ = [
    "ModelConfig", "Transformer", "KVCache", "SamplingParams", "decode_step", "get_kv_cache_mode", "init_model",
    "logits", "prefill", "register_kv_cache_mode", "sample", "validate_prompts",
]
