"""Hooks other packages rely on: `Transformer.ffn_inputs` (calibration) and model-specialised cache modes."""

import numpy as np

import configs
from moe_jax import decode
from moe_jax.kv_cache import DenseMode, get_kv_cache_mode
from moe_jax.moe import MoE


def test_ffn_inputs_are_what_the_moe_layers_see(tiny_model, monkeypatch):
  seen = []
  original = MoE.__call__

  def recording(self, x, **kwargs):
    seen.append(np.asarray(x))
    return original(self, x, **kwargs)

  monkeypatch.setattr(MoE, "__call__", recording)
  tokens = np.random.default_rng(0).integers(0, 256, (2, 9)).astype(np.int32)
  tiny_model.forward(tokens)  # eager: the recorder sees concrete arrays
  monkeypatch.setattr(MoE, "__call__", original)
  hooked = [np.asarray(h) for h in tiny_model.ffn_inputs(tokens)]
  assert len(seen) == len(hooked) == tiny_model.config.n_layers
  for a, b in zip(seen, hooked):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


def test_cache_modes_specialise_to_the_model():
  qwen = configs.get("qwen3_30b_a3b")
  assert get_kv_cache_mode("oskvp", qwen).rope_theta == qwen.rope_theta  # keys fitted at the model's RoPE base
  assert get_kv_cache_mode("oskvp").rope_theta == 1e4
  assert get_kv_cache_mode("bf16", qwen) == DenseMode("bfloat16")  # modes without the hook are returned as is


def test_prefill_uses_the_model_rope_base(tiny_config):
  """A model with another RoPE base still decodes through an OS-KVP cache fitted at that base."""
  model = decode.init_model(tiny_config.replace(rope_theta=1e6), seed=1)
  tokens = np.random.default_rng(1).integers(0, 256, (1, 12)).astype(np.int32)
  _, cache = decode.prefill(model, tokens, [12], kv_cache="oskvp", cache_len=64)
  logits, cache = decode.decode_step(model, cache, tokens[:, 0])
  _, dense = decode.prefill(model, tokens, [12], kv_cache="fp32", cache_len=64)
  ref, _ = decode.decode_step(model, dense, tokens[:, 0])
  rel = np.linalg.norm(np.asarray(logits) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
  assert int(cache.lengths[0]) == 13
  assert rel < 0.25, rel  # the tolerance of tests/moe_jax/kv_quant's model-level OS-KVP test
