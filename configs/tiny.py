"""Presets that are instantiated: `tiny` for CPU tests, `small` for one H200."""

from moe_jax.config import ModelConfig
from moe_jax.tokenizer import VOCAB_SIZE

# Qwen3-style block (QK-norm, softmax router, renormalised top-k) with a gated shared expert so that every code path
# of the MoE layer runs in the CPU tests.
TINY = ModelConfig(
    name="tiny", vocab_size=VOCAB_SIZE, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
    n_experts=8, n_experts_per_tok=2, expert_hidden=96, shared_expert_hidden=64, shared_expert_gate=True,
    qk_norm=True, rope_theta=10000.0, max_seq_len=1024,
)

# ~2.0B parameters (bf16: ~4 GB), leaving >120 GB of an H200 for KV cache.
SMALL = ModelConfig(
    name="small", vocab_size=32768, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4, head_dim=128,
    n_experts=16, n_experts_per_tok=4, expert_hidden=1024, qk_norm=True, rope_theta=1e6, max_seq_len=131072,
    param_dtype="bfloat16",
)
