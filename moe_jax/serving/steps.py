"""The serving engine's compiled device functions: prefill a bucket, extend it by a chunk, sample first tokens,
insert prefilled rows into slots, and the one decode step over all slots.

Each is jitted once at module level, so every engine over the same model structure shares the compiled code, and
each traces only for a new shape (pass the model as a `FlatModel` (`moe_jax.flat_model`), as the engine does, to
keep the per-call cost of a deep model's parameters low) (`TRACES` counts the traces per function: the "no
recompilation after warm-up" check of the tests reads it). The slot cache is donated to `insert` and
`decode_slots`, so on an accelerator the cache is updated in place rather than copied every step.

Shapes: B slots (the engine's `num_slots`), P rows of a prefill bucket, T bucket length, C chunk length, S cache
length, V vocab.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

from moe_jax.flat_model import FlatModel  # noqa: F401  (re-exported: `steps.FlatModel`)
from moe_jax.flat_model import module as _module
from moe_jax.kv_cache import KVCache, get_kv_cache_mode
from moe_jax.sampling import sample

TRACES: collections.Counter = collections.Counter()  # function name -> times traced (each trace is a compile)


def _count(name):
  def wrap(fn):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
      TRACES[name] += 1  # Runs at trace time only: a cache hit does not execute the Python body.
      return fn(*args, **kwargs)
    return traced
  return wrap


def _sample_or_argmax(logits, key, temperature, top_k, top_p):
  """`sample`, skipping its full-vocabulary sort when every row is greedy (the same tokens either way)."""
  return jax.lax.cond(jnp.any(temperature > 0), lambda: sample(logits, key, temperature, top_k, top_p),
                      lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def total_traces() -> int:
  return sum(TRACES.values())


@functools.partial(jax.jit, static_argnames=("kv_cache", "cache_len"))
@_count("prefill")
def prefill(model, tokens: jax.Array, lengths: jax.Array, *, kv_cache: str, cache_len: int):
  """Prompts of one bucket -> logits at each row's last prompt token and the rows' cache.

  Args:
    tokens: int32 [P, T] right-padded.
    lengths: int32 [P], 1 <= lengths <= T.

  Returns:
    (float32 [P, V], KVCache of P rows, S = cache_len).
  """
  module = _module(model)
  return module.prefill(tokens, lengths, mode=get_kv_cache_mode(kv_cache, module.config), cache_len=cache_len,
                        mode_name=kv_cache, logits_at=lengths - 1)  # the LM head on P rows, not P·T


@jax.jit
@_count("extend")
def extend(model, cache: KVCache, tokens: jax.Array, valid: jax.Array, last: jax.Array):
  """One chunk of a long prompt appended to prefilled rows (dense caches: `extend` with T = C > 1).

  Args:
    cache: KVCache of P rows.
    tokens: int32 [P, C], the next chunk of each row, right-padded.
    valid: int32 [P], real tokens in the chunk (0 for rows whose prompt has ended).
    last: float32 [P, V], logits at each row's last token so far.

  Returns:
    (last logits float32 [P, V], cache with lengths + valid). Padding positions are written past each row's
    length; they are never visible (attention shows positions <= the query's) and the next token overwrites them.
  """
  starts = cache.lengths
  chunk_last, cache = _module(model).decode(cache, tokens, logits_at=jnp.maximum(valid - 1, 0))
  last = jnp.where((valid > 0)[:, None], chunk_last, last)
  return last, cache.replace(lengths=starts + valid)


def step_key(key: jax.Array, step: jax.Array) -> jax.Array:
  """The key of one engine step: step uint32 [2] (the count's low and high words) folded into key."""
  return jax.random.fold_in(jax.random.fold_in(key, step[0]), step[1])


@jax.jit
@_count("sample_rows")
def sample_rows(last: jax.Array, key: jax.Array, step: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array):
  """First tokens of prefilled rows: last [P, V] -> (int32 [P], bool [P] logits all finite)."""
  finite = jnp.all(jnp.isfinite(last), axis=-1)
  return _sample_or_argmax(last, step_key(key, step), temperature, top_k, top_p), finite


@functools.partial(jax.jit, donate_argnums=(0,))
@_count("insert")
def insert(slot_cache: KVCache, rows: KVCache, slots: jax.Array) -> KVCache:
  """Copies prefilled rows into slots: every leaf has the batch leading, so this is one tree_map.

  Args:
    slot_cache: KVCache of B slots (donated).
    rows: KVCache of P rows, same mode and S.
    slots: int32 [P], destination slot per row; an index >= B drops the row (padding rows of a bucket).
  """
  layers = jax.tree_util.tree_map(lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop"),
                                  slot_cache.layers, rows.layers)
  lengths = slot_cache.lengths.at[slots].set(rows.lengths, mode="drop")
  return slot_cache.replace(layers=layers, lengths=lengths)


@functools.partial(jax.jit, donate_argnums=(1,))
@_count("decode_slots")
def decode_slots(model, cache: KVCache, tokens: jax.Array, active: jax.Array, key: jax.Array, step: jax.Array,
                 temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
  """One token for every slot; inactive slots compute too (fixed shape) but keep their length.

  Args:
    cache: KVCache of B slots (donated).
    tokens: int32 [B], each slot's last token.
    active: bool [B].
    key: PRNG key; step: uint32 [2], the engine's step count (low, high words) folded into it.
    temperature, top_k, top_p: per-slot sampling parameters [B].

  Returns:
    (next tokens int32 [B], bool [B] logits all finite, cache with active lengths + 1).
  """
  cache = cache.replace(layers=tuple(_idle_slots_skip_refit(layer, active) for layer in cache.layers))
  logits, new = _module(model).decode(cache, tokens[:, None])
  logits = logits[:, 0]
  finite = jnp.all(jnp.isfinite(logits), axis=-1)
  nxt = _sample_or_argmax(logits, step_key(key, step), temperature, top_k, top_p)
  return nxt, finite, new.replace(lengths=jnp.where(active, new.lengths, cache.lengths))


def _idle_slots_skip_refit(layer, active: jax.Array):
  """An OS-KVP layer cache whose free slots no longer wait to refit at their first flush (`OSKVPMode.
  refit_at_first_flush`): they step too and would all refit, on idle tokens, at one step. `insert` sets the flag
  again for a request."""
  if getattr(layer, "refit", None) is None:
    return layer
  return layer.replace(refit=layer.refit & active)


@functools.partial(jax.jit, static_argnames=("num_slots",))
@_count("tile")
def tile(rows: KVCache, *, num_slots: int) -> KVCache:
  """A B-slot cache whose every slot is a copy of row 0 of `rows` (the engine's initial, all-free cache)."""
  rep = lambda x: jnp.repeat(x[:1], num_slots, axis=0)  # noqa: E731
  return rows.replace(layers=jax.tree_util.tree_map(rep, rows.layers), lengths=rep(rows.lengths))
