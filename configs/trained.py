"""The shape of the shipped trained checkpoint `tiny-trained` (moe_jax/assets/tiny-trained/).

Chosen to fit in <= 10 MB stored in bfloat16 (~4.5M parameters, ~9 MB) while keeping real head dims (H = 64, as
compressed KV caches need) and several layers. Byte-level vocabulary, trained on the stdlib corpus of `moe_jax.data`.
Reproduce with the command in README.md (section "Training").
"""

from moe_jax.config import ModelConfig
from moe_jax.tokenizer import VOCAB_SIZE

TINY_TRAINED = ModelConfig(
    name="tiny-trained", vocab_size=VOCAB_SIZE, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
    n_experts=8, n_experts_per_tok=2, expert_hidden=128, shared_expert_hidden=128, shared_expert_gate=True,
    qk_norm=True, rope_theta=10000.0, max_seq_len=1024,
)
