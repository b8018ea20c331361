"""Model configuration: one frozen, validated dataclass, and the analytical numbers it implies.

Presets live in `configs/` as Python; `python -m moe_jax.config --preset=NAME` prints a preset's parameter count,
active bytes per token and KV bytes per token without instantiating anything.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import jax.numpy as jnp

RouterKind = Literal["softmax", "sigmoid"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and options of a decoder-only MoE transformer.

  Attributes:
    name: preset name, for reports.
    vocab_size: V.
    d_model: D.
    n_layers: number of decoder blocks.
    n_heads: N query heads.
    n_kv_heads: K key/value heads (N % K == 0; G = N // K).
    head_dim: H.
    n_experts: E routed experts per MoE layer.
    n_experts_per_tok: X experts chosen per token.
    expert_hidden: F, the hidden size of one routed expert.
    shared_expert_hidden: hidden size of the always-on shared expert (0: none).
    shared_expert_gate: scale the shared expert by sigmoid(x·w) as in Qwen2-MoE.
    dense_layers: indices of blocks whose FFN is a dense SwiGLU instead of MoE.
    dense_hidden: hidden size of those dense FFNs.
    router: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3 style) affinities.
    norm_topk_prob: renormalise the chosen experts' weights to sum to one.
    qk_norm: RMSNorm over H on queries and keys before RoPE (Qwen3).
    qkv_bias: biases on the q/k/v projections (Qwen2).
    tie_embeddings: the LM head reuses the embedding matrix.
    rope_theta: RoPE base.
    rms_eps: RMSNorm epsilon.
    max_seq_len: longest sequence the model supports (prompt + generation).
    param_dtype: dtype the weights are stored in: float32, bfloat16 or float16 (on the CPU, float16 attention
      computes in float32: `attention.causal_attention`).
  """

  name: str = "custom"
  vocab_size: int = 256
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 16
  n_experts: int = 8
  n_experts_per_tok: int = 2
  expert_hidden: int = 128
  shared_expert_hidden: int = 0
  shared_expert_gate: bool = False
  dense_layers: tuple[int, ...] = ()
  dense_hidden: int = 0
  router: RouterKind = "softmax"
  norm_topk_prob: bool = True
  qk_norm: bool = False
  qkv_bias: bool = False
  tie_embeddings: bool = False
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  max_seq_len: int = 2048
  param_dtype: str = "float32"

  def __post_init__(self):
    positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
                "n_experts_per_tok", "expert_hidden", "max_seq_len")
    for field in positive:
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field}={value!r} must be a positive int")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates channel pairs)")
    if self.n_experts_per_tok > self.n_experts:
      raise ValueError(f"n_experts_per_tok={self.n_experts_per_tok} must be <= n_experts={self.n_experts}")
    for field in ("shared_expert_hidden", "dense_hidden"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field}={value!r} must be an int >= 0")
    if self.shared_expert_gate and not self.shared_expert_hidden:
      raise ValueError("shared_expert_gate=True needs shared_expert_hidden > 0")
    if not isinstance(self.dense_layers, tuple):
      raise ValueError(f"dense_layers={self.dense_layers!r} must be a tuple of layer indices")
    for i in self.dense_layers:
      if not isinstance(i, int) or isinstance(i, bool):  # 1.5 matched no layer, True was layer 1
        raise ValueError(f"dense_layers contains {i!r}: layer indices must be ints")
      if not 0 <= i < self.n_layers:
        raise ValueError(f"dense_layers contains {i}, outside [0, n_layers={self.n_layers})")
    if self.dense_layers and self.dense_hidden <= 0:
      raise ValueError(f"dense_hidden={self.dense_hidden} must be > 0 when dense_layers is set")
    for field in ("shared_expert_gate", "norm_topk_prob", "qk_norm", "qkv_bias", "tie_embeddings"):
      if not isinstance(getattr(self, field), bool):  # a config.json's "false" is a true string
        raise ValueError(f"{field}={getattr(self, field)!r} must be true or false")
    for field in ("rope_theta", "rms_eps"):
      if not isinstance(getattr(self, field), (int, float)) or isinstance(getattr(self, field), bool):
        raise ValueError(f"{field}={getattr(self, field)!r} must be a number")
    if self.router not in ("softmax", "sigmoid"):
      raise ValueError(f"router={self.router!r} must be 'softmax' or 'sigmoid'")
    if not 0 < self.rope_theta < float("inf"):  # also refuses NaN
      raise ValueError(f"rope_theta={self.rope_theta} must be > 0")
    if not 0 < self.rms_eps < 1:  # also refuses NaN
      raise ValueError(f"rms_eps={self.rms_eps} must be in (0, 1)")
    if self.param_dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"param_dtype={self.param_dtype!r} must be float32, bfloat16 or float16")

  @property
  def dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def q_per_kv(self) -> int:
    """G, query heads per kv head."""
    return self.n_heads // self.n_kv_heads

  def is_moe_layer(self, i: int) -> bool:
    return i not in self.dense_layers

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def _attention_params(c: ModelConfig) -> int:
  n = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.d_model
  if c.qkv_bias:
    n += (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
  if c.qk_norm:
    n += 2 * c.head_dim
  return n + 2 * c.d_model  # two RMSNorm scales per block


def param_counts(c: ModelConfig) -> dict[str, int]:
  """Total and per-token-active parameter counts, from the shapes alone."""
  embed = c.vocab_size * c.d_model
  head = 0 if c.tie_embeddings else c.vocab_size * c.d_model
  expert = 3 * c.d_model * c.expert_hidden
  shared = 3 * c.d_model * c.shared_expert_hidden + (c.d_model if c.shared_expert_gate else 0)
  n_moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
  n_dense = c.n_layers - n_moe
  attn = c.n_layers * _attention_params(c)
  router = n_moe * c.d_model * c.n_experts
  dense = n_dense * 3 * c.d_model * c.dense_hidden
  total = embed + head + attn + router + dense + n_moe * (c.n_experts * expert + shared) + c.d_model
  # The embedding row read per token is negligible; the LM head (the embedding itself when tied) is read whole.
  active = embed + attn + router + dense + n_moe * (c.n_experts_per_tok * expert + shared) + c.d_model
  return {"total": total, "active": active, "per_expert": expert, "embedding": embed}


def kv_bytes_per_token(c: ModelConfig, bytes_per_element: float = 2.0) -> float:
  """Bytes of K and V one token adds to the cache over all layers."""
  return 2 * c.n_layers * c.n_kv_heads * c.head_dim * bytes_per_element


def analytical_report(c: ModelConfig, bytes_per_weight: float = 2.0) -> dict:
  counts = param_counts(c)
  return {
      "preset": c.name,
      "params_total": counts["total"],
      "params_active_per_token": counts["active"],
      "active_weight_bytes_per_token": counts["active"] * bytes_per_weight,
      "total_weight_bytes": counts["total"] * bytes_per_weight,
      "kv_bytes_per_token_bf16": kv_bytes_per_token(c),
      "kv_bytes_per_token_per_layer_bf16": kv_bytes_per_token(c) / c.n_layers,
  }


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  import configs  # pylint: disable=g-import-not-at-top

  report = analytical_report(configs.get(flags.FLAGS.preset, flag="--preset"))
  if flags.FLAGS.json:
    print(json.dumps(report, indent=2))
    return
  for k, v in report.items():
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1e6:
      print(f"{k:36s} {v:>20,.0f}  ({v / 1e9:.3f} G)")
    else:
      print(f"{k:36s} {v!s:>20}")


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_string("preset", "tiny", "Preset name from configs/.")
  flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
  app.run(main)
