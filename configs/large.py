"""Published shapes of large MoE models, and the seed's 480B model. Never instantiated: analytical numbers only."""

from moe_jax.config import ModelConfig

# mistralai/Mixtral-8x7B-v0.1 config.json.
MIXTRAL_8X7B = ModelConfig(
    name="mixtral_8x7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
    n_experts=8, n_experts_per_tok=2, expert_hidden=14336, rope_theta=1e6, rms_eps=1e-5, max_seq_len=32768,
    param_dtype="bfloat16",
)

# Qwen/Qwen3-30B-A3B config.json.
QWEN3_30B_A3B = ModelConfig(
    name="qwen3_30b_a3b", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    n_experts=128, n_experts_per_tok=8, expert_hidden=768, qk_norm=True, rope_theta=1e6, max_seq_len=40960,
    param_dtype="bfloat16",
)

# Qwen/Qwen3-235B-A22B config.json.
QWEN3_235B_A22B = ModelConfig(
    name="qwen3_235b_a22b", vocab_size=151936, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
    n_experts=128, n_experts_per_tok=8, expert_hidden=1536, qk_norm=True, rope_theta=1e6, max_seq_len=40960,
    param_dtype="bfloat16",
)

# The seed's model: ~480B total with 32 routed experts active per token. The seed gives only those two numbers;
# the remaining shapes are our choice (Qwen3-style blocks, 256 fine-grained experts, 8 kv heads).
SEED_480B = ModelConfig(
    name="seed_480b", vocab_size=151936, d_model=6144, n_layers=65, n_heads=64, n_kv_heads=8, head_dim=128,
    n_experts=256, n_experts_per_tok=32, expert_hidden=1536, qk_norm=True, rope_theta=1e6, max_seq_len=131072,
    param_dtype="bfloat16",
)
