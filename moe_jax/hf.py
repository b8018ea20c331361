"""Loading Hugging Face checkpoints: a model directory (`config.json` + `*.safetensors`) -> (ModelConfig, Transformer),
and its `tokenizer.json` -> a tokenizer with the interface of `moe_jax.tokenizer.ByteTokenizer`.

    config, model = moe_jax.hf.load("path/to/Qwen3-30B-A3B", dtype=jnp.bfloat16)
    logits = moe_jax.logits(model, tokens)  # float32 [B, T, V]

Supported `model_type`s are the converters registered in `moe_jax.hf_convert` (mixtral, qwen3_moe, qwen2_moe).
Tensors are read one at a time with safetensors' numpy loader (bf16 included), transposed to our layouts, cast to
`dtype` (the router stays float32) and put into a model built with `nnx.eval_shape`, so no random initialisation is
spent on weights that are about to be overwritten. Every error names what is wrong: an unsupported `model_type` or
config option, a tensor that is missing or has the wrong shape, a tensor the converter does not use, a shard listed in
`model.safetensors.index.json` that is not there.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from moe_jax.config import ModelConfig
from moe_jax.hf_convert import get_converter
from moe_jax.model import Transformer

INDEX = "model.safetensors.index.json"


def read_config(path: str) -> dict:
  """The directory's config.json as a dict."""
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise ValueError(f"{path!r} is not a Hugging Face model directory: no config.json")
  with open(file) as f:
    return json.load(f)


class Checkpoint:
  """The safetensors files of a directory, single or sharded, read lazily tensor by tensor.

  Tracks which tensors were read so that `unused()` can report those no converter consumed.
  """

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
      with open(index) as f:
        meta = json.load(f)
      if not isinstance(meta, dict) or not isinstance(meta.get("weight_map"), dict):
        raise ValueError(f"{INDEX} in {path!r} has no \"weight_map\" dict (tensor name -> shard file)")
      self.weight_map: dict[str, str] = dict(meta["weight_map"])
      for file in sorted(set(self.weight_map.values())):
        if not os.path.isfile(os.path.join(path, file)):
          raise ValueError(f"{INDEX} in {path!r} lists shard {file!r}, which is not in the directory")
    else:
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if not files:
        raise ValueError(f"{path!r} has no *.safetensors files (and no {INDEX})")
      self.weight_map = {}
      for file in files:
        with safe_open(file, framework="np") as f:
          for name in f.keys():
            if name in self.weight_map:  # which copy is meant is unknowable without an index
              raise ValueError(f"tensor {name!r} is in both {self.weight_map[name]!r} and "
                               f"{os.path.basename(file)!r} of {path!r} (and there is no {INDEX})")
            self.weight_map[name] = os.path.basename(file)
    self._handles = {}
    self.used: set[str] = set()

  def __enter__(self) -> "Checkpoint":
    return self

  def __exit__(self, *exc) -> None:
    self._handles.clear()

  def _open(self, name: str):
    file = self.weight_map[name]
    if file not in self._handles:
      self._handles[file] = safe_open(os.path.join(self.path, file), framework="np")
    handle = self._handles[file]
    if name not in handle.keys():
      raise ValueError(f"{INDEX} in {self.path!r} places tensor {name!r} in {file!r}, which does not hold it")
    return handle

  def has(self, name: str) -> bool:
    return name in self.weight_map

  def missing(self, name: str, note: str = "") -> ValueError:
    return ValueError(f"checkpoint {self.path!r} has no tensor {name!r}{note}")

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name`, checked to have `shape` (the shape config.json implies)."""
    if name not in self.weight_map:
      raise self.missing(name)
    handle = self._open(name)
    actual = tuple(handle.get_slice(name).get_shape())
    if actual != tuple(shape):
      raise ValueError(f"tensor {name!r} in {self.weight_map[name]!r} has shape {actual}, but config.json implies "
                       f"{tuple(shape)}")
    self.used.add(name)
    return handle.get_tensor(name)

  def unused(self, ignored=lambda name: False) -> list[str]:
    return sorted(n for n in self.weight_map if n not in self.used and not ignored(n))


def load(path: str, dtype=jnp.float32, *, moe_implementation: str = "xla") -> tuple[ModelConfig, Transformer]:
  """Reads a Hugging Face model directory into a moe-jax Transformer.

  Args:
    path: directory with config.json and *.safetensors (one file, several, or shards with
      model.safetensors.index.json).
    dtype: parameter dtype (float32, bfloat16 or float16). The router weights stay float32.
    moe_implementation: grouped-matmul implementation of the MoE layers.

  Returns:
    (ModelConfig, Transformer) with every weight taken from the checkpoint.

  Raises:
    ValueError: unsupported model_type or option, missing tensor, shape mismatch, or unused tensors.
  """
  hf_config = read_config(path)
  converter = get_converter(hf_config.get("model_type"))
  name = os.path.basename(os.path.normpath(path)) or "hf"
  config = converter.model_config(hf_config, name=name, dtype=jnp.dtype(dtype).name)
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), moe_implementation=moe_implementation))
  unset = {p: v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
  with Checkpoint(path) as ckpt:
    for var_path, array in converter.weights(config, ckpt):
      var = unset.pop(var_path)
      target = var.get_value()  # a ShapeDtypeStruct until set
      if array.shape != target.shape:  # a converter bug, not a checkpoint problem
        raise ValueError(f"converter {converter.model_type!r} built {array.shape} for {var_path}, "
                         f"expected {target.shape}")
      var.set_value(jnp.asarray(np.asarray(array).astype(target.dtype)))
    unused = ckpt.unused(lambda n: converter.ignored(n, config))
  if unset:
    raise ValueError(f"converter {converter.model_type!r} left parameters unset: {sorted(map(str, unset))}")
  if unused:
    more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
    raise ValueError(f"checkpoint {path!r} has tensors the {converter.model_type!r} converter does not use "
                     f"(an unsupported variant?): {unused[:8]}{more}")
  return config, model


def _json(path: str, file: str) -> dict:
  file = os.path.join(path, file)
  if not os.path.isfile(file):
    return {}
  with open(file) as f:
    return json.load(f)


def _special_id(path: str, tokenizer, key: str) -> int | None:
  """bos/eos/pad id from generation_config.json, config.json, then tokenizer_config.json's token string."""
  for file in ("generation_config.json", "config.json"):
    value = _json(path, file).get(f"{key}_token_id")
    if isinstance(value, list):
      value = value[0] if value else None
    if value is not None:
      return int(value)
  token = _json(path, "tokenizer_config.json").get(f"{key}_token")
  if isinstance(token, dict):
    token = token.get("content")
  return tokenizer.token_to_id(token) if isinstance(token, str) else None


class HFTokenizer:
  """`tokenizer.json` through the `tokenizers` package, with the interface of `moe_jax.tokenizer.ByteTokenizer`.

  `encode` applies the tokenizer's own post-processor (which adds BOS for Mixtral/Llama, nothing for Qwen); `decode`
  drops special tokens. `eos_id` is the first of config.json's eos ids when it lists several (None if none given).
  """

  def __init__(self, tokenizer, *, bos_id: int | None, eos_id: int | None, pad_id: int | None):
    self.tokenizer = tokenizer
    self.bos_id, self.eos_id = bos_id, eos_id
    self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    """The ids of text; UnicodeEncodeError (a ValueError) where it is not UTF-8, as the byte tokenizer's."""
    text.encode("utf-8")  # a lone surrogate ("\ud800"), which `tokenizers` refuses with a TypeError
    return list(self.tokenizer.encode(text).ids)

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) >= 0]
    return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str) -> HFTokenizer:
  """The directory's tokenizer.json (ValueError if there is none)."""
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

  file = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(file):
    raise ValueError(f"{path!r} has no tokenizer.json")
  tok = Tokenizer.from_file(file)
  return HFTokenizer(tok, bos_id=_special_id(path, tok, "bos"), eos_id=_special_id(path, tok, "eos"),
                     pad_id=_special_id(path, tok, "pad"))
