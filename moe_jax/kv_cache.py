"""The KV cache: an explicit pytree passed into `decode_step` and returned, in one of several storage modes.

A mode (`kv_cache="bf16"`, `"fp32"`, and the compressed modes of `moe_jax.kv_quant`) is a small frozen object whose
`from_prefill` builds one layer's cache from the prefill keys/values (`prefill_layers` builds all of a model's,
through the mode's `from_prefill_layers` where it has one); the layer cache then serves decode attention
itself (`extend`), so `decode_step` needs no mode argument; it also reports `max_len` (S) and `kv_shape` (K, H),
which `decode_step` checks against the model. Every leaf of a layer cache has the batch as its leading axis, so the
serving engine can move a sequence between caches with one `tree_map`.

Keys are stored after RoPE: q·k is then exact for any storage basis, and decode needs no re-rotation.
Shape letters: B batch, T new tokens, S cache length, N query heads, K kv heads, G = N / K, H head dim.

The compressed modes are for inference: what goes into them passes `inference_only`, whose gradient is an error
naming the way out (differentiate with a dense cache). Before, a gradient through them was silently unrelated to
the dense one (rounding has zero derivative, fp8 casts flushed the cotangents, OS-KVP's fit was differentiated).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@jax.custom_vjp
def inference_only(x: jax.Array) -> jax.Array:
  """x unchanged; differentiating through it raises (see the module docstring)."""
  return x


def _inference_only_fwd(x):
  return x, None


def _inference_only_bwd(_, g):
  del g
  raise ValueError("a gradient reached a compressed KV cache (kv_cache= a mode of moe_jax.kv_quant): they are "
                   "inference-only. Differentiate with kv_cache='fp32' or 'bf16', or stop_gradient what you store")


inference_only.defvjp(_inference_only_fwd, _inference_only_bwd)


@jax.jit
def masked_gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
  """Grouped-query attention with an explicit visibility mask, softmax in float32.

  Args:
    q: [B, T, N, H].
    k, v: [B, S, K, H].
    visible: bool [B, T, S].

  Returns:
    [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, t, kh, n // kh, h).astype(jnp.float32)
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * h**-0.5
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32))
  return out.reshape(b, t, n, h).astype(q.dtype)


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
  """One query per sequence over a dense cache.

  Args:
    q: [B, N, H].
    k, v: [B, S, K, H].
    lengths: int32 [B], keys s < lengths[b] are visible (each >= 1).

  Returns:
    [B, N, H].
  """
  visible = jnp.arange(k.shape[1])[None, None, :] < lengths[:, None, None]  # [B, 1, S]
  return masked_gqa_attention(q[:, None], k, v, visible)[:, 0]


@struct.dataclass
class DenseKV:
  """Uncompressed per-layer cache. k, v: [B, S, K, H] in the mode's dtype."""

  k: jax.Array
  v: jax.Array

  def extend(self, q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array) -> tuple[jax.Array, "DenseKV"]:
    """Writes T new tokens at positions starts[b] + t and attends causally over the cache.

    Args:
      q: [B, T, N, H]; k, v: [B, T, K, H] (post-RoPE).
      starts: int32 [B], tokens already in the cache per sequence.

    Returns:
      ([B, T, N, H], updated cache). Writes past the cache's end are dropped (callers validate lengths first).
    """
    b, t = q.shape[:2]
    pos = starts[:, None] + jnp.arange(t)[None, :]  # [B, T]
    rows = jnp.arange(b)[:, None]
    new = DenseKV(k=self.k.at[rows, pos].set(k.astype(self.k.dtype), mode="drop"),
                  v=self.v.at[rows, pos].set(v.astype(self.v.dtype), mode="drop"))
    visible = jnp.arange(self.k.shape[1])[None, None, :] <= pos[:, :, None]  # [B, T, S]
    return masked_gqa_attention(q, new.k, new.v, visible), new

  @property
  def max_len(self) -> int:
    """S, the positions this cache holds."""
    return int(self.k.shape[1])

  @property
  def kv_shape(self) -> tuple[int, int]:
    """(K, H): kv heads and head dim the cache holds."""
    return int(self.k.shape[2]), int(self.k.shape[3])

  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes


@dataclasses.dataclass(frozen=True)
class DenseMode:
  """Stores K and V as they are, in `dtype`."""

  dtype: str = "bfloat16"

  def from_prefill(self, k: jax.Array, v: jax.Array, lengths: jax.Array, cache_len: int, *, layer: int) -> DenseKV:
    """k, v: [B, T, K, H] prefill keys/values (T <= cache_len) -> DenseKV with S = cache_len."""
    del lengths, layer  # positions >= lengths hold padding; attention masks them by length.
    b, t, kh, h = k.shape
    if cache_len < t:  # (the compressed modes say the same; before, a jnp.pad error under jit)
      raise ValueError(f"cache_len={cache_len} is shorter than the prefill length {t}")
    pad = ((0, 0), (0, cache_len - t), (0, 0), (0, 0))
    return DenseKV(k=jnp.pad(k.astype(self.dtype), pad), v=jnp.pad(v.astype(self.dtype), pad))


@struct.dataclass
class KVCache:
  """The model's whole cache: one layer cache per block, and the per-sequence lengths (tokens cached).

  Attributes:
    layers: tuple of layer caches (`DenseKV` or a compressed mode's type).
    lengths: int32 [B].
    mode: the `kv_cache=` name it was built with.
  """

  layers: tuple[Any, ...]
  lengths: jax.Array
  mode: str = struct.field(pytree_node=False, default="bf16")

  @property
  def max_len(self) -> int:
    return int(self.layers[0].max_len)

  def nbytes(self) -> int:
    """Bytes the cache occupies on device, every leaf counted (codes, scales, bases, residual windows)."""
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self.layers)) + int(self.lengths.nbytes)


def extend_token_by_token(step, cache, q: jax.Array, k: jax.Array, v: jax.Array, after_first=None):
  """`extend` for caches that take one token at a time: `step(cache, q_t, k_t, v_t) -> (o_t, cache)` on each of T
  tokens, the first traced on its own, the rest as one `lax.scan` (the program's size does not grow with T).

  Args:
    step: (cache, q_t [B, N, H], k_t, v_t [B, K, H]) -> (o_t [B, N, H], cache), the cache's structure and types
      unchanged.
    cache: the layer cache (a pytree) the tokens are appended to.
    q: [B, T, N, H]; k, v: [B, T, K, H], T static.
    after_first: cache -> cache, applied after the first token (e.g. to clear a flag that holds for it only).

  Returns:
    ([B, T, N, H] as `step` returns them, cache); for T = 0, zeros in q's dtype and the cache through `after_first`.
  """
  after_first = after_first or (lambda c: c)
  if q.shape[1] == 0:  # nothing appended: [B, 0, N, H], as the dense caches
    return jnp.zeros(q.shape, q.dtype), after_first(cache)
  o, cache = step(cache, q[:, 0], k[:, 0], v[:, 0])
  cache = after_first(cache)
  if q.shape[1] == 1:
    return o[:, None], cache

  def body(c, xs):
    o_t, c = step(c, *xs)
    return c, o_t

  rest_time_major = lambda x: jnp.swapaxes(x[:, 1:], 0, 1)  # noqa: E731  [B, T, ...] -> [T - 1, B, ...]
  cache, rest = jax.lax.scan(body, cache, (rest_time_major(q), rest_time_major(k), rest_time_major(v)))
  return jnp.concatenate([o[:, None], jnp.swapaxes(rest, 0, 1)], axis=1), cache


def prefill_layers(mode, kvs, lengths: jax.Array, cache_len: int) -> tuple:
  """Every layer's cache from a prefill: kvs holds one (k, v) [B, T, K, H] per layer (keys post-RoPE), lengths
  int32 [B]. The mode's `from_prefill_layers(kvs, lengths, cache_len)` where it has one (OS-KVP fits all layers'
  caches in a few batched fits), else its `from_prefill` layer by layer."""
  many = getattr(mode, "from_prefill_layers", None)
  if many is not None:
    return tuple(many(kvs, lengths, cache_len))
  return tuple(mode.from_prefill(k, v, lengths, cache_len, layer=i) for i, (k, v) in enumerate(kvs))


def before_step(layers: tuple) -> tuple:
  """A decode step's work on its whole cache before the first layer runs: each layer type's `before_step(layers)`
  (a static method taking and returning all layers; OS-KVP refits its first flushes there for every layer at once,
  `moe_jax.kv_quant.oskvp_cache.refit_before_step`). Layer types without one are left as they are."""
  for hook in dict.fromkeys(getattr(type(layer), "before_step", None) for layer in layers):
    if hook is not None:
      layers = hook(layers)
  return layers


KV_CACHE_MODES: dict[str, Any] = {"bf16": DenseMode("bfloat16"), "fp32": DenseMode("float32")}


def register_kv_cache_mode(name: str, mode: Any) -> None:
  KV_CACHE_MODES[name] = mode


def get_kv_cache_mode(name: str, config=None):
  """Returns the mode object for `kv_cache=name`, with a clear error for unknown names.

  With a `ModelConfig`, a mode that depends on the model (OS-KVP fits keys at the model's RoPE base) is specialised
  through its optional `for_config(config)` method.
  """
  if name not in KV_CACHE_MODES:
    try:  # Compressed modes register themselves on import.
      import moe_jax.kv_quant  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      pass
  if name not in KV_CACHE_MODES:
    raise ValueError(f"kv_cache={name!r} is not a KV cache mode; choose one of {sorted(KV_CACHE_MODES)}")
  mode = KV_CACHE_MODES[name]
  for_config = getattr(mode, "for_config", None)
  return for_config(config) if (config is not None and for_config is not None) else mode
