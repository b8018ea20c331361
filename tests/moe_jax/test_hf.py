"""Hugging Face checkpoint loading: parity with transformers' PyTorch models on tiny random checkpoints, and clear
errors for what the loader does not support.

The checkpoints and reference outputs under tests/fixtures/hf/ were written by tests/fixtures/make_hf_fixtures.py
(transformers 5.24.0, torch 2.13.0 CPU, float32); neither package is needed here.
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moe_jax
from moe_jax import hf
from moe_jax.decode import decode_step, prefill

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
TYPES = ("mixtral", "qwen3_moe", "qwen2_moe")
REL_TOL = 1e-4


def fixture(name: str) -> str:
  return os.path.join(FIXTURES, name)


@pytest.fixture(scope="module")
def loaded():
  return {name: hf.load(fixture(name)) for name in TYPES}


def reference(name: str):
  return np.load(os.path.join(fixture(name), "reference.npz"))


def rel_err(ours: np.ndarray, ref: np.ndarray, lengths) -> float:
  """max |ours - ref| / max |ref| over the valid positions of each prompt (worst prompt)."""
  return max(float(np.abs(ours[i, :n] - ref[i, :n]).max() / np.abs(ref[i, :n]).max())
             for i, n in enumerate(lengths))


def copy(name: str, tmp_path) -> str:
  dst = os.path.join(tmp_path, name)
  shutil.copytree(fixture(name), dst)
  return dst


def edit_json(path: str, **changes) -> None:
  with open(path) as f:
    data = json.load(f)
  data.update(changes)
  with open(path, "w") as f:
    json.dump(data, f)


@pytest.mark.parametrize("name", TYPES)
def test_logits_match_transformers(loaded, name):
  _, model = loaded[name]
  ref = reference(name)
  ours = np.asarray(moe_jax.logits(model, jnp.asarray(ref["tokens"])))
  assert ours.dtype == np.float32 and ours.shape == ref["logits"].shape
  assert rel_err(ours, ref["logits"], ref["lengths"]) <= REL_TOL


@pytest.mark.parametrize("name", TYPES)
def test_greedy_continuation_matches_transformers(loaded, name):
  """A ragged batch of two prompts through prefill + 31 decode steps (fp32 cache) reproduces the 32 tokens."""
  _, model = loaded[name]
  ref = reference(name)
  lengths = ref["lengths"]
  out, cache = prefill(model, ref["tokens"], lengths, kv_cache="fp32", cache_len=64)
  assert rel_err(np.asarray(out), ref["logits"], lengths) <= REL_TOL
  nxt = jnp.argmax(out[jnp.arange(len(lengths)), jnp.asarray(lengths) - 1], axis=-1).astype(jnp.int32)
  tokens = [nxt]
  for _ in range(ref["greedy"].shape[1] - 1):
    step, cache = decode_step(model, cache, nxt)
    nxt = jnp.argmax(step, axis=-1).astype(jnp.int32)
    tokens.append(nxt)
  np.testing.assert_array_equal(np.stack(tokens, axis=1), ref["greedy"])


def test_config_translation(loaded):
  mixtral, qwen3, qwen2 = (loaded[n][0] for n in TYPES)
  assert (mixtral.n_experts, mixtral.n_experts_per_tok, mixtral.norm_topk_prob, mixtral.n_kv_heads) == (8, 2, True, 1)
  assert mixtral.rope_theta == 1e6 and mixtral.rms_eps == 1e-5 and not mixtral.tie_embeddings
  assert qwen3.qk_norm and qwen3.tie_embeddings and qwen3.head_dim == 16 and qwen3.d_model == 32
  assert qwen3.dense_layers == (1,) and qwen3.dense_hidden == 40 and qwen3.norm_topk_prob
  assert qwen2.qkv_bias and qwen2.shared_expert_gate and qwen2.shared_expert_hidden == 48
  assert qwen2.dense_layers == (0, 2) and not qwen2.norm_topk_prob and not qwen2.qk_norm


def fuse_experts(path: str, module: str, names: tuple[str, str, str]) -> None:
  """Rewrites a single-file checkpoint with transformers 5's in-memory fused expert tensors."""
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  gate, up, down = names
  for prefix in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
    p = f"{prefix}.experts."
    n = len({k for k in tensors if k.startswith(p) and k.endswith(f".{gate}.weight")})
    g = np.stack([tensors.pop(f"{p}{e}.{gate}.weight") for e in range(n)])  # [E, F, D]
    u = np.stack([tensors.pop(f"{p}{e}.{up}.weight") for e in range(n)])
    tensors[p + "gate_up_proj"] = np.concatenate([g, u], axis=1)  # [E, 2F, D]
    tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{e}.{down}.weight") for e in range(n)])  # [E, D, F]
  tensors = {k.replace(".block_sparse_moe.", f".{module}."): v for k, v in tensors.items()}
  save_file(tensors, file)


def merge_shards(path: str) -> None:
  """Sharded directory -> one model.safetensors."""
  tensors = {}
  for file in os.listdir(path):
    if file.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(path, file)))
      os.remove(os.path.join(path, file))
  os.remove(os.path.join(path, hf.INDEX))
  save_file(tensors, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_expert_tensors(loaded, name, tmp_path):
  """The same weights stored fused (gate_up_proj [E, 2F, D], down_proj [E, D, F]; Mixtral's block named `mlp`)."""
  path = copy(name, tmp_path)
  if name == "mixtral":
    merge_shards(path)
    fuse_experts(path, "mlp", ("w1", "w3", "w2"))
  else:
    fuse_experts(path, "mlp", ("gate_proj", "up_proj", "down_proj"))
  config, model = hf.load(path)
  assert config.replace(name="x") == loaded[name][0].replace(name="x")
  ref = reference(name)
  ours = np.asarray(moe_jax.logits(model, jnp.asarray(ref["tokens"])))
  assert rel_err(ours, ref["logits"], ref["lengths"]) <= REL_TOL


def test_bfloat16_load(loaded):
  config, model = hf.load(fixture("qwen3_moe"), dtype=jnp.bfloat16)
  assert config.param_dtype == "bfloat16"
  assert model.blocks[0].attn.wq[...].dtype == jnp.bfloat16
  assert model.blocks[0].ffn.w_router[...].dtype == jnp.float32  # routing stays in float32
  np.testing.assert_array_equal(np.asarray(model.embedding[...]),
                                np.asarray(loaded["qwen3_moe"][1].embedding[...].astype(jnp.bfloat16)))


def test_unsupported_model_type(tmp_path):
  path = copy("qwen3_moe", tmp_path)
  edit_json(os.path.join(path, "config.json"), model_type="llama")
  with pytest.raises(ValueError, match=r"model_type='llama' is not supported.*mixtral"):
    hf.load(path)


def test_unsupported_options(tmp_path):
  path = copy("qwen3_moe", tmp_path)
  edit_json(os.path.join(path, "config.json"), rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4})
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    hf.load(path)
  # Qwen's documented YaRN switch (rope_scaling) beside a default rope_parameters (before: loaded as plain RoPE).
  edit_json(os.path.join(path, "config.json"), rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match="rope_scaling rope_type='yarn'"):
    hf.load(path)
  edit_json(os.path.join(path, "config.json"), rope_scaling={"type": "linear", "factor": 2.0})
  with pytest.raises(ValueError, match="rope_scaling rope_type='linear'"):
    hf.load(path)
  edit_json(os.path.join(path, "config.json"), rope_parameters=None, rope_scaling=None, hidden_act="gelu")
  with pytest.raises(ValueError, match="hidden_act='gelu'"):
    hf.load(path)
  edit_json(os.path.join(path, "config.json"), hidden_act="silu", decoder_sparse_step=0)  # was a ZeroDivisionError
  with pytest.raises(ValueError, match="decoder_sparse_step=0 must be an int >= 1"):
    hf.load(path)


@pytest.mark.parametrize("field, value, message", [
    ("tie_word_embeddings", "false", "must be true or false"),  # before: tied (logits off by up to 20.5)
    ("norm_topk_prob", "false", "must be true or false"),  # before: renormalised
    ("num_experts_per_tok", True, "must be an integer"),  # before: top-1
    ("num_hidden_layers", 4.9, "must be an integer"),  # before: 4 layers
    ("use_sliding_window", "false", "must be true or false"),  # before: the window capped max_seq_len
    ("rope_parameters", [1], "must be an object"),  # before: an AttributeError
])
def test_config_fields_of_the_wrong_type_are_named(tmp_path, field, value, message):
  """The converters cast config.json's fields (bool("false") is True, int(4.9) is 4), so a wrong type built another
  model without a word; now the field is named."""
  path = copy("qwen2_moe", tmp_path)
  edit_json(os.path.join(path, "config.json"), **{field: value})
  with pytest.raises(ValueError, match=f"config.json {field}=.* {message}"):
    hf.load(path)


def test_not_a_model_directory(tmp_path):
  with pytest.raises(ValueError, match="no config.json"):
    hf.load(str(tmp_path))
  path = copy("qwen3_moe", tmp_path)
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match="no \\*.safetensors"):
    hf.load(path)


def test_missing_tensor_single_file(tmp_path):
  path = copy("qwen3_moe", tmp_path)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  del tensors["model.layers.2.self_attn.k_norm.weight"]
  save_file(tensors, file)
  with pytest.raises(ValueError, match="no tensor 'model.layers.2.self_attn.k_norm.weight'"):
    hf.load(path)


def test_missing_expert_and_shard(tmp_path):
  path = copy("mixtral", tmp_path)
  index = os.path.join(path, hf.INDEX)
  with open(index) as f:
    data = json.load(f)
  del data["weight_map"]["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
  with open(index, "w") as f:
    json.dump(data, f)
  with pytest.raises(ValueError, match="no tensor 'model.layers.1.block_sparse_moe.experts.5.w3.weight'"):
    hf.load(path)
  os.remove(os.path.join(path, "model-00007-of-00007.safetensors"))
  with pytest.raises(ValueError, match="shard 'model-00007-of-00007.safetensors'"):
    hf.load(path)
  with open(index, "w") as f:
    json.dump({"metadata": {}}, f)  # was a bare KeyError
  with pytest.raises(ValueError, match=r"has no \"weight_map\" dict"):
    hf.load(path)


def test_shape_mismatch(tmp_path):
  path = copy("qwen2_moe", tmp_path)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  name = "model.layers.3.mlp.shared_expert.up_proj.weight"
  tensors[name] = tensors[name][:, :-1]
  save_file(tensors, file)
  with pytest.raises(ValueError, match=rf"tensor '{name}' .* shape \(48, 31\), but config.json implies \(48, 32\)"):
    hf.load(path)


def test_config_disagrees_with_tensors(tmp_path):
  """A config.json that claims more experts than the file holds fails on the first missing expert."""
  path = copy("qwen2_moe", tmp_path)
  edit_json(os.path.join(path, "config.json"), num_experts=7)
  with pytest.raises(ValueError, match=r"shape \(6, 32\), but config.json implies \(7, 32\)"):
    hf.load(path)


def test_unused_tensor(tmp_path):
  path = copy("qwen3_moe", tmp_path)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros((32,), np.float32)
  save_file(tensors, file)
  with pytest.raises(ValueError, match="does not use.*model.layers.0.self_attn.o_proj.bias"):
    hf.load(path)


def test_tokenizer():
  tok = hf.load_tokenizer(fixture("mixtral"))
  assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size <= 128
  text = "The quick brown fox routes tokens to experts."
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and all(0 <= i < 128 for i in ids) and len(ids) < len(text)
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray([ids + [tok.eos_id]])) == text  # special tokens dropped, any shape accepted


def test_tokenizer_refuses_text_utf8_cannot_hold_as_the_byte_tokenizer_does():
  """A lone surrogate (valid JSON, e.g. a batch_decode line or a server prompt): `tokenizers` raised a TypeError,
  which the callers (catching UnicodeError / ValueError, as the byte tokenizer raises) did not expect: one such
  line stopped a whole batch_decode run, at every resume."""
  from moe_jax import batch_decode  # pylint: disable=g-import-not-at-top
  tok = hf.load_tokenizer(fixture("mixtral"))
  with pytest.raises(UnicodeEncodeError):
    tok.encode("bad \ud800 text")
  with pytest.raises(batch_decode.BadLine, match="\"prompt\" is not encodable text"):
    batch_decode.parse_line('{"id": 2, "prompt": "bad \\ud800 text"}', tok, 4)


def test_tokenizer_missing(tmp_path):
  with pytest.raises(ValueError, match="no tokenizer.json"):
    hf.load_tokenizer(fixture("qwen3_moe"))


def test_a_tensor_in_two_unindexed_files_is_refused(tmp_path):
  save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "a.safetensors"))
  save_file({"model.embed_tokens.weight": np.ones((2, 2), np.float32)}, str(tmp_path / "b.safetensors"))
  with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' is in both 'a.safetensors' and "
                                       r"'b.safetensors'"):
    hf.Checkpoint(str(tmp_path))  # before: the last file's copy, silently
