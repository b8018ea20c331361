"""The decoder-only MoE transformer as Flax NNX modules.

Data flow of one step: tokens -> embedding -> blocks (attention with its cache, then MoE or dense FFN) -> final norm
-> LM head. `moe_jax/decode.py` wraps the three entry points (`forward`, `prefill`, `decode`) as pure jitted
functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.attention import Attention
from moe_jax.config import ModelConfig
from moe_jax.kv_cache import DenseMode, KVCache, before_step, inference_only, prefill_layers
from moe_jax.layers import DenseMLP, RMSNorm, normal_init
from moe_jax.moe import MoE


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)); x + ffn(norm(x))."""

  def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, moe_implementation: str = "xla"):
    self.attn_norm = RMSNorm(config.d_model, eps=config.rms_eps, dtype=config.dtype)
    self.attn = Attention(config, rngs=rngs)
    self.ffn_norm = RMSNorm(config.d_model, eps=config.rms_eps, dtype=config.dtype)
    if config.is_moe_layer(layer):
      self.ffn = MoE(config, rngs=rngs, implementation=moe_implementation)
    else:
      self.ffn = DenseMLP(config.d_model, config.dense_hidden, dtype=config.dtype, rngs=rngs)

  def feed_forward(self, x: jax.Array, *, decoding: bool = False) -> tuple[jax.Array, dict]:
    """x: [B, T, D] -> (x + ffn(norm(x)), router aux); decoding: the call comes from `decode` (see `MoE.__call__`)."""
    h = self.ffn_norm(x)
    if isinstance(self.ffn, MoE):
      y, aux = self.ffn(h, decoding=decoding)
    else:
      y, aux = self.ffn(h), {}
    return x + y, aux

  def __call__(self, x: jax.Array, positions: jax.Array):
    """x: [B, T, D] -> ([B, T, D], aux, (k, v)) with k, v: [B, T, K, H] for building a cache."""
    a, kv = self.attn(self.attn_norm(x), positions)
    x, aux = self.feed_forward(x + a)
    return x, aux, kv

  def decode(self, x: jax.Array, positions: jax.Array, layer_cache):
    a, layer_cache = self.attn.decode(self.attn_norm(x), positions, layer_cache)
    x, _ = self.feed_forward(x + a, decoding=True)
    return x, layer_cache


class Transformer(nnx.Module):
  """Token embedding, `n_layers` blocks, final RMSNorm, LM head (tied or untied)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, moe_implementation: str = "xla"):
    self.config = config
    d, v, dt = config.d_model, config.vocab_size, config.dtype
    self.embedding = nnx.Param((jax.random.normal(rngs.params(), (v, d), jnp.float32)).astype(dt))  # [V, D]
    self.blocks = nnx.List([Block(config, i, rngs=rngs, moe_implementation=moe_implementation)
                            for i in range(config.n_layers)])
    self.final_norm = RMSNorm(d, eps=config.rms_eps, dtype=dt)
    self.lm_head = None if config.tie_embeddings else nnx.Param(normal_init(rngs.params(), (d, v), d, dt))  # [D, V]

  def embed(self, tokens: jax.Array) -> jax.Array:
    """int32 [B, T] -> [B, T, D]."""
    return jnp.take(self.embedding[...], tokens, axis=0)

  def unembed(self, x: jax.Array) -> jax.Array:
    """[B, T, D] -> float32 logits [B, T, V]."""
    x = self.final_norm(x)
    w = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
    return jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)

  def logits_at(self, x: jax.Array, at: jax.Array | None) -> jax.Array:
    """x [B, T, D] -> float32 logits [B, T, V], or with `at` (int32 [B], one position per row) [B, V] at those
    positions only: the LM head then runs on B rows, not B·T (serving needs each row's last; at a real vocabulary
    the [B, T, V] logits of a prefill bucket are gigabytes)."""
    if at is None:
      return self.unembed(x)
    return self.unembed(jnp.take_along_axis(x, at[:, None, None], axis=1))[:, 0]

  def _blocks(self, tokens: jax.Array, positions: jax.Array | None = None):
    """The full causal pass up to the final norm (positions default 0..T-1): ([B, T, D], per-MoE-layer aux list,
    per-layer kv)."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = self.embed(tokens)
    auxes, kvs = [], []
    for block in self.blocks:
      x, aux, kv = block(x, positions)
      kvs.append(kv)
      if aux:
        auxes.append(aux)
    return x, auxes, kvs

  def forward(self, tokens: jax.Array, positions: jax.Array | None = None):
    """Full causal pass (training, scoring). Returns (logits f32 [B, T, V], per-MoE-layer aux list, per-layer kv)."""
    x, auxes, kvs = self._blocks(tokens, positions)
    return self.unembed(x), auxes, kvs

  def ffn_inputs(self, tokens: jax.Array) -> list[jax.Array]:
    """Calibration hook: the normalised input of every block's feed-forward, one [B, T, D] per block."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = self.embed(tokens)
    out = []
    for block in self.blocks:
      a, _ = block.attn(block.attn_norm(x), positions)
      x = x + a
      out.append(block.ffn_norm(x))
      x, _ = block.feed_forward(x)
    return out

  def prefill(self, tokens: jax.Array, lengths: jax.Array, *, mode, cache_len: int, mode_name: str,
              logits_at: jax.Array | None = None):
    """tokens: int32 [B, T] right-padded; lengths: int32 [B] -> (logits [B, T, V], KVCache); with `logits_at`
    (int32 [B]) the logits are [B, V] at those positions (`logits_at`)."""
    # Padding is read as token 0: whatever id pads a row (one outside the vocabulary embeds as NaN, and NaN keys and
    # values reach the row's valid outputs through attention's 0 · NaN), the valid positions are unaffected.
    tokens = jnp.where(jnp.arange(tokens.shape[1])[None, :] < lengths[:, None], tokens, 0)
    x, _, kvs = self._blocks(tokens)
    if not isinstance(mode, DenseMode):
      kvs = [(inference_only(k), inference_only(v)) for k, v in kvs]
    layers = prefill_layers(mode, kvs, lengths, cache_len)
    return self.logits_at(x, logits_at), KVCache(layers=layers, lengths=lengths.astype(jnp.int32), mode=mode_name)

  def decode(self, cache: KVCache, tokens: jax.Array, *, logits_at: jax.Array | None = None):
    """tokens: int32 [B, T] appended after each sequence's cached tokens -> (logits [B, T, V], KVCache); with
    `logits_at` (int32 [B], positions in the T new tokens) the logits are [B, V] there (`logits_at`)."""
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    x = self.embed(tokens)
    layers = []
    for block, layer_cache in zip(self.blocks, before_step(cache.layers)):
      x, layer_cache = block.decode(x, positions, layer_cache)
      layers.append(layer_cache)
    cache = cache.replace(layers=tuple(layers), lengths=cache.lengths + tokens.shape[1])
    return self.logits_at(x, logits_at), cache
