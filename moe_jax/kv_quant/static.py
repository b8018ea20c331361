"""Static OS-KVP: U and codebooks calibrated once per (layer, kv head) on calibration text, saved with orbax.

  mode = static.calibrate_model(model, tokens, lengths)   # keys/values captured by model.forward
  mode = static.calibrate_on_training_split(model)         # the same on 16 training-split windows of 1024 tokens
  static.save("/path/oskvp_static", mode); mode = static.load("/path/oskvp_static")
  static.install(mode)                                    # now kv_cache="oskvp_static" uses it
Prompts then pay no per-sequence fitting, and short prompts get codebooks fitted on plenty of data. The command-line
tools (`moe_jax.cli.setup_kv_cache`) calibrate with `calibrate_on_training_split` when given
`--kv_cache=oskvp_static`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.kv_cache import KV_CACHE_MODES, register_kv_cache_mode
from moe_jax.kv_quant import oskvp
from moe_jax.kv_quant.oskvp_modes import StaticOSKVPMode


def calibrate_layers(kvs, lengths, *, outlier_fraction: float = 0.08, bits: int = 2,
                     n_iters: int = oskvp.DEFAULT_LLOYD_ITERS) -> tuple[oskvp.OSKVPParams, oskvp.OSKVPParams]:
  """Per-(layer, kv head) calibration.

  Args:
    kvs: per-layer (k, v) pairs, each [B, T, K, H] (keys post-RoPE), e.g. `model.forward(tokens)[2]`.
    lengths: int32 [B] valid tokens per row.

  Returns:
    (params_k, params_v), OSKVPParams with leading [n_layers, K].
  """
  h = kvs[0][0].shape[-1]
  oskvp.check_head_dim(h, bits, outlier_fraction)
  n_out = oskvp.n_outliers(h, outlier_fraction)
  b, t = kvs[0][0].shape[:2]
  w = (jnp.arange(t)[None, :] < jnp.asarray(lengths)[:, None]).astype(jnp.float32).reshape(b * t)

  @jax.jit
  def per_layer(x):  # [B, T, K, H] -> params with leading [K]
    xs = jnp.transpose(x, (2, 0, 1, 3)).reshape(x.shape[2], b * t, h)  # [K, B·T, H], rows batch-major like w
    return jax.vmap(lambda xk: oskvp.fit(xk, w, n_outlier=n_out, bits=bits, n_iters=n_iters))(xs)

  for i, (k, v) in enumerate(kvs):
    for name, x in (("keys", k), ("values", v)):
      valid = np.asarray(x)[np.asarray(w.reshape(b, t)) > 0]
      if not np.isfinite(valid).all():
        raise ValueError(f"layer {i} calibration {name} contain non-finite values")
  stack = lambda ps: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ps)
  return (stack([per_layer(k) for k, _ in kvs]), stack([per_layer(v) for _, v in kvs]))


def calibrate_model(model, tokens, lengths=None, *, outlier_fraction: float = 0.08, bits: int = 2,
                    window: int = 128, implementation: str = "auto") -> StaticOSKVPMode:
  """Runs `model.forward(tokens)` (int32 [B, T], right-padded; lengths int32 [B], default all T) and calibrates."""
  from moe_jax import decode  # pylint: disable=g-import-not-at-top  (decode imports the cache modes)

  tokens = np.asarray(tokens)
  lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32) if lengths is None else np.asarray(lengths)
  decode.validate_prompts(model.config, tokens, lengths, cache_len=model.config.max_seq_len)
  h = model.config.head_dim
  if int(lengths.sum()) < h:  # fewer samples than channels: no basis to fit, the codebooks would be guesses
    raise ValueError(f"static calibration needs at least head_dim={h} tokens, got {int(lengths.sum())}")
  tokens, lengths = jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)
  _, _, kvs = jax.jit(lambda m, t: m.forward(t))(model, tokens)
  params_k, params_v = calibrate_layers(kvs, lengths, outlier_fraction=outlier_fraction, bits=bits)
  return StaticOSKVPMode(params_k=params_k, params_v=params_v, window=window, implementation=implementation)


BYTES_PER_TOKEN = 8  # text read per window for a subword tokenizer: seq_len tokens of code take ~3-4 bytes each


def _text_windows(byte_tokens: np.ndarray, tokenizer, n_windows: int, seq_len: int) -> np.ndarray:
  """int32 [n_windows, seq_len]: evenly spaced stretches of the byte-token stream, decoded to text (file boundaries
  as newlines) and re-tokenized by `tokenizer` (its encode: text -> ids), cut to seq_len tokens."""
  from moe_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from moe_jax.tokenizer import BOS_ID  # pylint: disable=g-import-not-at-top

  span = min(BYTES_PER_TOKEN * seq_len, byte_tokens.size - 2)
  rows = []
  for row in data_lib.eval_windows(byte_tokens, n_windows=n_windows, seq_len=span - 1):
    text = np.where(row == BOS_ID, ord("\n"), row).astype(np.uint8).tobytes().decode("utf-8", "replace")
    ids = list(tokenizer.encode(text))
    if len(ids) < seq_len:
      raise ValueError(f"seq_len={seq_len}: {span} bytes of the training split give only {len(ids)} tokens of this "
                       "tokenizer; pass a smaller seq_len or tokens=")
    rows.append(ids[:seq_len])
  return np.asarray(rows, np.int32)


def calibrate_on_training_split(model, *, n_windows: int = 16, seq_len: int = 1024, tokens: np.ndarray | None = None,
                                tokenizer=None, **kwargs) -> StaticOSKVPMode:
  """`calibrate_model` on the default calibration data: `n_windows` evenly spaced windows of `seq_len` tokens of the
  training split of `moe_jax.data` (never validation), or of `tokens` (a 1-D token stream) when given.

  Args:
    model: the Transformer.
    n_windows: windows (the calibration batch), >= 1.
    seq_len: tokens per window (at most the model's max_seq_len).
    tokens: the stream to cut the windows from (default: the training split, byte tokens).
    tokenizer: the model's tokenizer when it is not the byte tokenizer (e.g. `hf.load_tokenizer`): the split's text
      is tokenized by it, so that a Hugging Face model is calibrated on its own token ids, not on byte ids.
    **kwargs: passed to `calibrate_model` (outlier_fraction, bits, window, implementation).
  """
  from moe_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from moe_jax.tokenizer import ByteTokenizer  # pylint: disable=g-import-not-at-top

  if not isinstance(n_windows, int) or n_windows < 1:
    raise ValueError(f"n_windows={n_windows!r} must be an int >= 1")
  if not 2 <= seq_len <= model.config.max_seq_len:
    raise ValueError(f"seq_len={seq_len} must be in [2, max_seq_len={model.config.max_seq_len}]")
  if tokens is not None and tokenizer is not None:
    raise ValueError("pass tokens (already token ids) or tokenizer (to tokenize the training split), not both")
  if tokenizer is not None and not isinstance(tokenizer, ByteTokenizer):
    windows = _text_windows(data_lib.load_corpus()["train"].tokens, tokenizer, n_windows, seq_len)
  else:
    tokens = data_lib.load_corpus()["train"].tokens if tokens is None else tokens
    windows = data_lib.eval_windows(tokens, n_windows=n_windows, seq_len=seq_len - 1)  # [n_windows, seq_len]
  return calibrate_model(model, windows, **kwargs)


def install(mode: StaticOSKVPMode, name: str = "oskvp_static") -> None:
  """Registers `mode` as `kv_cache=name`. Replacing an installed mode clears jax's compilation caches, because the
  jitted prefill is keyed by the mode's name and would otherwise keep the old params."""
  if name in KV_CACHE_MODES and KV_CACHE_MODES[name] is not mode:
    jax.clear_caches()
  register_kv_cache_mode(name, mode)


def save(path: str, mode: StaticOSKVPMode) -> None:
  """Writes the calibration (params and window) as an orbax checkpoint at `path` (absolute or relative)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if mode.params_k is None:
    raise ValueError("cannot save an uncalibrated static mode")
  tree = {"k": mode.params_k, "v": mode.params_v, "window": np.int32(mode.window)}
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.abspath(path), jax.tree_util.tree_map(np.asarray, tree), force=True)


def load(path: str, *, implementation: str = "auto") -> StaticOSKVPMode:
  """Reads a calibration written by `save`."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  with ocp.StandardCheckpointer() as ckpt:
    tree = ckpt.restore(os.path.abspath(path))
  as_params = lambda d: oskvp.OSKVPParams(u=jnp.asarray(d["u"]), scale=jnp.asarray(d["scale"]),
                                          codebook=jnp.asarray(d["codebook"]))
  return StaticOSKVPMode(params_k=as_params(tree["k"]), params_v=as_params(tree["v"]), window=int(tree["window"]),
                         implementation=implementation)
