"""Per-family converters from Hugging Face checkpoints to moe-jax: `config.json` -> `ModelConfig`, and tensor names
and layouts -> our parameter paths.

A new model family is one more `Converter` registered in `CONVERTERS` (a config translation plus the names of its
expert tensors); the layers themselves never know which family they came from. All three supported families share the
Llama naming (`model.layers.{i}.self_attn.q_proj.weight`, ...); they differ in config keys and in the MoE block:

  mixtral    `block_sparse_moe.gate` router, experts `experts.{e}.w1/w3/w2` (gate/up/down), always renormalised.
  qwen3_moe  `mlp.gate` router, experts `experts.{e}.gate_proj/up_proj/down_proj`; QK-norm; dense layers through
             `mlp_only_layers` / `decoder_sparse_step`.
  qwen2_moe  as qwen3_moe without QK-norm, plus q/k/v biases and a sigmoid-gated shared expert
             (`mlp.shared_expert.*`, `mlp.shared_expert_gate`).

Experts are read either per expert (what `save_pretrained` writes, transformers 4.x and 5.x) or fused as transformers
5.x holds them in memory: `experts.gate_up_proj` [E, 2F, D] (gate rows first) and `experts.down_proj` [E, D, F].

Layouts: torch `Linear.weight` is [out, in]; ours are [in, out] with heads split out: wq [D, N, H], wk/wv [D, K, H],
wo [N, H, D], experts [E, D, F] / [E, F, D], router [D, E], embedding [V, D], LM head [D, V].
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from moe_jax.config import ModelConfig

Path = tuple  # an NNX variable path, e.g. ("blocks", 0, "attn", "wq")


class TensorSource(Protocol):
  """What a converter reads from: `moe_jax.hf.Checkpoint`."""

  def has(self, name: str) -> bool: ...

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray: ...

  def missing(self, name: str, note: str = "") -> ValueError: ...


def _get(hf: dict, key: str, default=None, *, required: bool = False):
  if key in hf and hf[key] is not None:
    return hf[key]
  if required:
    raise ValueError(f"config.json has no {key!r}, needed for model_type={hf.get('model_type')!r}")
  return default


def _typed(hf: dict, key: str, kind: str, default=None, *, required: bool = False):
  """`_get` of a field that must be a bool, an int or a number ("bool" / "int" / "float"; an int is a number, a
  bool is neither): ValueError naming the key otherwise. A cast would take "false" as True and cut 2.7 to 2."""
  v = _get(hf, key, default, required=required)
  ok = {"bool": isinstance(v, bool), "int": isinstance(v, int) and not isinstance(v, bool),
        "float": isinstance(v, (int, float)) and not isinstance(v, bool)}[kind]
  if v is not None and not ok:
    want = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind]
    raise ValueError(f"config.json {key}={v!r} must be {want}")
  return float(v) if kind == "float" and v is not None else v


def _n_experts(hf: dict) -> int:
  """Qwen's `num_experts`, or `num_local_experts` (0 if neither)."""
  return _typed(hf, "num_experts", "int") or _typed(hf, "num_local_experts", "int", 0)


def rope_theta(hf: dict, default: float) -> float:
  """RoPE base from `rope_parameters` (transformers 5) or `rope_theta` (4.x); only plain RoPE is supported."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for field, d in (("rope_parameters", params), ("rope_scaling", scaling)):  # each on its own: either may scale
    if not isinstance(d, dict):
      raise ValueError(f"config.json {field}={d!r} must be an object")
    kind = d.get("rope_type") or d.get("type") or "default"
    if kind != "default":
      raise ValueError(f"config.json {field} rope_type={kind!r} is not supported (only plain RoPE, "
                       "rope_type='default')")
  theta = params.get("rope_theta") or _typed(hf, "rope_theta", "float") or default
  if not isinstance(theta, (int, float)) or isinstance(theta, bool):
    raise ValueError(f"config.json rope_parameters.rope_theta={theta!r} must be a number")
  return float(theta)


def _check_common(hf: dict) -> None:
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json hidden_act={act!r} is not supported (SwiGLU experts need 'silu')")


def _max_seq_len(hf: dict) -> int:
  """max_position_embeddings, capped at the sliding window when one is on (then the window never slides)."""
  n = _typed(hf, "max_position_embeddings", "int", 4096)
  window = _typed(hf, "sliding_window", "int")
  if _typed(hf, "use_sliding_window", "bool", True) and window:
    n = min(n, window)
  return n


def base_config(hf: dict, *, name: str, dtype: str, rope_default: float) -> dict:
  """ModelConfig fields every Llama-style family shares."""
  _check_common(hf)
  d = _typed(hf, "hidden_size", "int", required=True)
  n = _typed(hf, "num_attention_heads", "int", required=True)
  return dict(
      name=name, vocab_size=_typed(hf, "vocab_size", "int", required=True), d_model=d,
      n_layers=_typed(hf, "num_hidden_layers", "int", required=True), n_heads=n,
      n_kv_heads=_typed(hf, "num_key_value_heads", "int", n), head_dim=_typed(hf, "head_dim", "int", d // n),
      n_experts_per_tok=_typed(hf, "num_experts_per_tok", "int", required=True),
      tie_embeddings=_typed(hf, "tie_word_embeddings", "bool", False), rope_theta=rope_theta(hf, rope_default),
      rms_eps=_typed(hf, "rms_norm_eps", "float", 1e-6), max_seq_len=_max_seq_len(hf), param_dtype=dtype)


def qwen_dense_layers(hf: dict, n_layers: int) -> tuple[int, ...]:
  """Qwen's rule: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
  only = set(_get(hf, "mlp_only_layers", []) or [])
  step = _get(hf, "decoder_sparse_step", 1)
  if isinstance(step, bool) or not isinstance(step, int) or step < 1:
    raise ValueError(f"config.json decoder_sparse_step={step!r} must be an int >= 1")
  return tuple(i for i in range(n_layers) if i in only or (i + 1) % step != 0)


class Converter:
  """A Llama-style family: shared attention/norm/embedding names; subclasses give the config and the MoE names."""

  model_type = ""
  moe_module = "mlp"  # the MoE block's module name under model.layers.{i}
  expert_names = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down

  def model_config(self, hf: dict, *, name: str, dtype: str) -> ModelConfig:
    raise NotImplementedError

  def ignored(self, name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model does not need."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")

  def weights(self, config: ModelConfig, src: TensorSource) -> Iterator[tuple[Path, np.ndarray]]:
    """Yields (our variable path, array in our layout) for every parameter of `Transformer(config)`."""
    c = config
    d, n, k, h, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size
    yield ("embedding",), src.get("model.embed_tokens.weight", (v, d))
    yield ("final_norm", "scale"), src.get("model.norm.weight", (d,))
    if not c.tie_embeddings:
      yield ("lm_head",), src.get("lm_head.weight", (v, d)).T
    for i in range(c.n_layers):
      p, blk = f"model.layers.{i}.", ("blocks", i)
      yield blk + ("attn_norm", "scale"), src.get(p + "input_layernorm.weight", (d,))
      yield blk + ("ffn_norm", "scale"), src.get(p + "post_attention_layernorm.weight", (d,))
      a = p + "self_attn."
      yield blk + ("attn", "wq"), src.get(a + "q_proj.weight", (n * h, d)).T.reshape(d, n, h)
      yield blk + ("attn", "wk"), src.get(a + "k_proj.weight", (k * h, d)).T.reshape(d, k, h)
      yield blk + ("attn", "wv"), src.get(a + "v_proj.weight", (k * h, d)).T.reshape(d, k, h)
      yield blk + ("attn", "wo"), src.get(a + "o_proj.weight", (d, n * h)).T.reshape(n, h, d)
      if c.qkv_bias:
        yield blk + ("attn", "bq"), src.get(a + "q_proj.bias", (n * h,)).reshape(n, h)
        yield blk + ("attn", "bk"), src.get(a + "k_proj.bias", (k * h,)).reshape(k, h)
        yield blk + ("attn", "bv"), src.get(a + "v_proj.bias", (k * h,)).reshape(k, h)
      if c.qk_norm:
        yield blk + ("attn", "q_norm", "scale"), src.get(a + "q_norm.weight", (h,))
        yield blk + ("attn", "k_norm", "scale"), src.get(a + "k_norm.weight", (h,))
      if c.is_moe_layer(i):
        yield from self.moe_weights(c, src, p + self.moe_module + ".", blk + ("ffn",))
      else:
        yield from swiglu(src, p + "mlp.", blk + ("ffn",), d, c.dense_hidden)

  def moe_weights(self, c: ModelConfig, src: TensorSource, p: str, ffn: Path) -> Iterator[tuple[Path, np.ndarray]]:
    d, e, f = c.d_model, c.n_experts, c.expert_hidden
    yield ffn + ("w_router",), src.get(p + "gate.weight", (e, d)).T
    yield ffn + ("router_bias",), np.zeros((e,), np.float32)
    yield from experts(src, p + "experts.", ffn, e, d, f, self.expert_names)
    if c.shared_expert_hidden:
      yield from swiglu(src, p + "shared_expert.", ffn + ("shared",), d, c.shared_expert_hidden)
    if c.shared_expert_gate:
      yield ffn + ("w_shared_gate",), src.get(p + "shared_expert_gate.weight", (1, d)).T


def swiglu(src: TensorSource, p: str, out: Path, d: int, f: int) -> Iterator[tuple[Path, np.ndarray]]:
  """gate_proj/up_proj [F, D] -> w_gate/w_up [D, F]; down_proj [D, F] -> w_down [F, D]."""
  yield out + ("w_gate",), src.get(p + "gate_proj.weight", (f, d)).T
  yield out + ("w_up",), src.get(p + "up_proj.weight", (f, d)).T
  yield out + ("w_down",), src.get(p + "down_proj.weight", (d, f)).T


def experts(src: TensorSource, p: str, out: Path, e: int, d: int, f: int,
            names: tuple[str, str, str]) -> Iterator[tuple[Path, np.ndarray]]:
  """Routed experts -> w_gate/w_up [E, D, F], w_down [E, F, D], from per-expert or fused tensors."""
  gate, up, down = names
  if src.has(p + "gate_up_proj") and not src.has(f"{p}0.{gate}.weight"):
    gate_up = src.get(p + "gate_up_proj", (e, 2 * f, d))  # [E, 2F, D], gate rows first
    yield out + ("w_gate",), gate_up[:, :f].transpose(0, 2, 1)
    yield out + ("w_up",), gate_up[:, f:].transpose(0, 2, 1)
    yield out + ("w_down",), src.get(p + "down_proj", (e, d, f)).transpose(0, 2, 1)
    return
  if not src.has(f"{p}0.{gate}.weight"):
    raise src.missing(f"{p}0.{gate}.weight", f" (nor the fused {p}gate_up_proj)")
  yield out + ("w_gate",), np.stack([src.get(f"{p}{i}.{gate}.weight", (f, d)).T for i in range(e)])
  yield out + ("w_up",), np.stack([src.get(f"{p}{i}.{up}.weight", (f, d)).T for i in range(e)])
  yield out + ("w_down",), np.stack([src.get(f"{p}{i}.{down}.weight", (d, f)).T for i in range(e)])


class MixtralConverter(Converter):
  model_type = "mixtral"
  moe_module = "block_sparse_moe"
  expert_names = ("w1", "w3", "w2")

  def model_config(self, hf: dict, *, name: str, dtype: str) -> ModelConfig:
    fields = base_config(hf, name=name, dtype=dtype, rope_default=1e6)
    return ModelConfig(**fields, n_experts=_typed(hf, "num_local_experts", "int", required=True),
                       expert_hidden=_typed(hf, "intermediate_size", "int", required=True), norm_topk_prob=True)

  def moe_weights(self, c, src, p, ffn):
    # transformers 5 names the block `mlp` in memory; files written by save_pretrained keep `block_sparse_moe`.
    if not src.has(p + "gate.weight") and p.endswith(".block_sparse_moe."):
      alt = p[: -len("block_sparse_moe.")] + "mlp."
      if src.has(alt + "gate.weight"):
        p = alt
    yield from super().moe_weights(c, src, p, ffn)


class Qwen3MoeConverter(Converter):
  model_type = "qwen3_moe"

  def model_config(self, hf: dict, *, name: str, dtype: str) -> ModelConfig:
    if hf.get("attention_bias"):
      raise ValueError("config.json attention_bias=True is not supported for qwen3_moe (o_proj bias)")
    fields = base_config(hf, name=name, dtype=dtype, rope_default=10000.0)
    dense = qwen_dense_layers(hf, fields["n_layers"])
    return ModelConfig(**fields, n_experts=_n_experts(hf),
                       expert_hidden=_typed(hf, "moe_intermediate_size", "int", required=True), dense_layers=dense,
                       dense_hidden=_typed(hf, "intermediate_size", "int", 0) if dense else 0,
                       norm_topk_prob=_typed(hf, "norm_topk_prob", "bool", False), qk_norm=True)


class Qwen2MoeConverter(Converter):
  model_type = "qwen2_moe"

  def model_config(self, hf: dict, *, name: str, dtype: str) -> ModelConfig:
    fields = base_config(hf, name=name, dtype=dtype, rope_default=10000.0)
    dense = qwen_dense_layers(hf, fields["n_layers"])
    shared = _typed(hf, "shared_expert_intermediate_size", "int", required=True)
    return ModelConfig(**fields, n_experts=_n_experts(hf),
                       expert_hidden=_typed(hf, "moe_intermediate_size", "int", required=True), dense_layers=dense,
                       dense_hidden=_typed(hf, "intermediate_size", "int", 0) if dense else 0,
                       shared_expert_hidden=shared, shared_expert_gate=shared > 0,
                       norm_topk_prob=_typed(hf, "norm_topk_prob", "bool", False),
                       qkv_bias=_typed(hf, "qkv_bias", "bool", True))


CONVERTERS: dict[str, Converter] = {}


def register_converter(converter: Converter) -> None:
  CONVERTERS[converter.model_type] = converter


def get_converter(model_type) -> Converter:
  if model_type not in CONVERTERS:
    raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {sorted(CONVERTERS)}")
  return CONVERTERS[model_type]


for _c in (MixtralConverter(), Qwen3MoeConverter(), Qwen2MoeConverter()):
  register_converter(_c)

__all__ = ["CONVERTERS", "Converter", "get_converter", "register_converter"]
