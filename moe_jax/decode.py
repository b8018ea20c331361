"""Pure, jit-compiled entry points: `logits`, `prefill`, `decode_step`; and input validation before jit.

The model is the first argument of each: the NNX module (a pytree of its parameters, flattened on every call: 1.8 ms
of host time at 48 layers) or, in a loop, `FlatModel.of(model)` (`moe_jax.flat_model`, flattened once: 0.15 ms); the
KV cache is passed in and returned. Validation is done on the host, before jit, so the hot path has no Python checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.config import ModelConfig
from moe_jax.flat_model import FlatModel, module
from moe_jax.kv_cache import KVCache, get_kv_cache_mode
from moe_jax.model import Transformer


def init_model(config: ModelConfig, *, seed: int = 0, moe_implementation: str = "xla") -> Transformer:
  """A randomly initialised model of `config`."""
  return Transformer(config, rngs=nnx.Rngs(seed), moe_implementation=moe_implementation)


@jax.jit
def _logits(model: Transformer | FlatModel, tokens: jax.Array) -> jax.Array:
  return module(model).forward(tokens)[0]


def logits(model: Transformer | FlatModel, tokens) -> jax.Array:
  """int32 [B, T] -> float32 logits [B, T, V] of a full causal pass (jitted; concrete token ids are checked first)."""
  if not isinstance(tokens, jax.Array):  # nested lists as prefill takes them
    tokens = np.asarray(tokens)
  check_logits_tokens(model.config, tokens)
  return _logits(model, jnp.asarray(tokens))


def check_logits_tokens(config: ModelConfig, tokens) -> None:
  """Raises ValueError naming what is wrong with `tokens` for a full pass: not int [B, T], longer than max_seq_len,
  or (when concrete) ids outside the vocabulary."""
  shape, dtype = np.shape(tokens), jnp.result_type(tokens)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"tokens must be an integer array [batch, length], got {dtype} {shape}")
  if shape[1] > config.max_seq_len:
    raise ValueError(f"tokens has length {shape[1]} > max_seq_len={config.max_seq_len} of the model")
  if not isinstance(tokens, jax.core.Tracer):
    check_token_ids(config, np.asarray(tokens))


@functools.partial(jax.jit, static_argnames=("kv_cache", "cache_len", "last_only"))
def _prefill(model, tokens, lengths, *, kv_cache: str, cache_len: int, last_only: bool = False):
  model = module(model)
  return model.prefill(tokens, lengths, mode=get_kv_cache_mode(kv_cache, model.config), cache_len=cache_len,
                       mode_name=kv_cache, logits_at=lengths - 1 if last_only else None)


def prefill(model: Transformer | FlatModel, tokens, lengths, *, kv_cache: str = "bf16", cache_len: int | None = None,
            last_only: bool = False) -> tuple[jax.Array, KVCache]:
  """Runs the prompts and builds the cache.

  Args:
    model: the Transformer, or a `FlatModel` of it.
    tokens: int32 [B, T], right-padded prompts.
    lengths: int32 [B], valid tokens per row (1 <= lengths <= T).
    kv_cache: cache mode name ("bf16", "fp32", or a compressed mode of `moe_jax.kv_quant`).
    cache_len: S, positions the cache holds (prompt + generated); default the model's max_seq_len.
    last_only: return only each row's logits at its last prompt token, [B, V] (the LM head runs on B rows instead of
      B·T; what generation needs).

  Returns:
    (float32 logits [B, T, V] ([B, V] with last_only), KVCache with lengths = lengths).
  """
  cache_len = model.config.max_seq_len if cache_len is None else cache_len
  get_kv_cache_mode(kv_cache)  # Clear error for an unknown mode before tracing.
  if not any(isinstance(a, jax.core.Tracer) for a in (tokens, lengths)):  # concrete prompts: check them by name
    validate_prompts(model.config, tokens, lengths, cache_len=cache_len)
  return _prefill(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), kv_cache=kv_cache,
                  cache_len=cache_len, last_only=last_only)


def decode_step(model: Transformer | FlatModel, cache: KVCache, tokens, *,
                donate: bool = False) -> tuple[jax.Array, KVCache]:
  """Appends one token per sequence (jitted).

  Args:
    model: the Transformer, or (in a Python loop) a `FlatModel` of it, which skips the per-call walk of the
      module's parameters (48 layers: 1.8 ms of host time a call against 0.15).
    tokens: int32 [B], the next token of each sequence. Host (numpy) ids are checked against the vocabulary first;
      ids already on the device are not (that check would wait for the device each step), and an id outside the
      vocabulary there gives NaN logits. So does a step on a row whose cache is full (lengths = cache_len): its
      token has no position to go to (the dense caches dropped it silently before, and the logits were wrong).
    donate: the step writes the new cache into `cache`'s buffers (XLA donation), which are invalid afterwards. A
      loop that drops the old cache wants it: without it every step copies the whole cache (the tiny model, batch
      8, a 4.2 MB bf16 cache of 1024 positions: 3.0-3.5 ms a step against 2.0-2.2 donated, on a 2-core CPU).

  Returns:
    (float32 logits [B, V] for the following position, KVCache with lengths + 1).
  """
  check_step_tokens(model.config, cache, tokens)
  return (_decode_step_donating if donate else _decode_step)(model, cache, tokens)


def check_step_tokens(config: ModelConfig, cache: KVCache, tokens) -> None:
  """Raises naming what is wrong with a decode step's `tokens`: not an integer array of the cache's batch shape, or
  (numpy ids, on the host) ids outside the vocabulary."""
  if not hasattr(tokens, "shape"):
    raise TypeError(f"tokens must be an integer array [B], got a {type(tokens).__name__}: pass jnp.asarray(tokens)")
  if tokens.shape != cache.lengths.shape or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be an integer array of shape {cache.lengths.shape} (one per sequence of the "
                     f"cache), got {tokens.dtype} {tokens.shape}")
  if isinstance(tokens, np.ndarray):
    check_token_ids(config, tokens)


def check_cache(config: ModelConfig, cache: KVCache) -> None:
  """Raises ValueError unless `cache` has the model's layers, kv heads and head dim (a cache of another model: its
  extra or missing layers would be dropped by the blocks' zip, other shapes fail deep in XLA)."""
  if len(cache.layers) != config.n_layers:
    raise ValueError(f"cache has {len(cache.layers)} layers but the model has {config.n_layers}: pass the cache "
                     "that prefill built for this model")
  want = (config.n_kv_heads, config.head_dim)
  for i, layer in enumerate(cache.layers):
    if layer.kv_shape != want:
      raise ValueError(f"cache layer {i} holds {layer.kv_shape[0]} kv heads of dim {layer.kv_shape[1]} but the model "
                       f"has {want[0]} of dim {want[1]}: pass the cache that prefill built for this model")


def _checked_step(model: Transformer | FlatModel, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
  model = module(model)
  check_cache(model.config, cache)
  return step_logits(model, cache, tokens)


_decode_step = jax.jit(_checked_step)
_decode_step_donating = jax.jit(_checked_step, donate_argnums=1)


def step_logits(model: Transformer, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
  """`model.decode` of one token per sequence -> (float32 logits [B, V], cache); NaN logits for a row whose cache
  was full (its token had no position). The body of the single-device and the sharded decode steps."""
  full = cache.lengths >= cache.max_len  # [B]
  out, cache = model.decode(cache, tokens[:, None])
  return jnp.where(full[:, None], jnp.nan, out[:, 0]), cache


def check_prompt_shape(tokens: np.ndarray) -> None:
  """Raises ValueError unless the prompts are [batch, length]."""
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")


def validate_prompts(config: ModelConfig, tokens, lengths, *, cache_len: int, max_new_tokens: int = 0) -> None:
  """Raises ValueError naming the field for prompts the model cannot run.

  Args:
    tokens: int [B, T] right-padded prompts.
    lengths: int [B].
    cache_len: positions the cache will hold.
    max_new_tokens: tokens to be generated after the prompt; all but the last are fed back, so the cache needs
      lengths + max_new_tokens - 1 positions.
  """
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
  if not isinstance(cache_len, (int, np.integer)) or cache_len < 1:
    raise ValueError(f"cache_len={cache_len!r} must be an int >= 1")
  check_prompt_shape(tokens)
  if tokens.shape[1] > cache_len:
    raise ValueError(f"tokens has {tokens.shape[1]} positions but cache_len={cache_len}: trim the padding to at most "
                     "cache_len or give a longer cache")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  if lengths.shape != (tokens.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"lengths must be integers of shape ({tokens.shape[0]},), got {lengths.dtype} {lengths.shape}")
  if np.any(lengths < 1):
    raise ValueError(f"empty prompt: lengths={lengths.tolist()} must all be >= 1")
  if np.any(lengths > tokens.shape[1]):
    raise ValueError(f"lengths={lengths.tolist()} exceed the token array's length {tokens.shape[1]}")
  if cache_len > config.max_seq_len:
    raise ValueError(f"cache_len={cache_len} exceeds max_seq_len={config.max_seq_len} of config {config.name!r}")
  if np.any(lengths + max(max_new_tokens - 1, 0) > cache_len):  # the last new token is never fed back
    raise ValueError(f"prompt too long: lengths={lengths.max()} + max_new_tokens={max_new_tokens} - 1 exceeds "
                     f"cache_len={cache_len}")
  check_token_ids(config, tokens, np.arange(tokens.shape[1])[None, :] < lengths[:, None])


def check_token_ids(config: ModelConfig, tokens: np.ndarray, valid: np.ndarray | None = None) -> None:
  """Raises ValueError naming the first token id outside the vocabulary among int `tokens` of any shape (where
  `valid`, bool of the same shape, if given)."""
  bad = (tokens < 0) | (tokens >= config.vocab_size)
  bad = bad if valid is None else bad & valid
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"token id {int(tokens[where])} at tokens[{', '.join(map(str, where))}] is outside the "
                     f"vocabulary [0, vocab_size={config.vocab_size})")
