"""KIVI 2-bit KV cache (`kv_cache="kivi2"`; Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization
for KV cache"): keys quantized per channel, values per token, both asymmetric (scale and zero point in float16, as
in the paper) with group size 32, and a full-precision residual window of the most recent R = 128 tokens.

Keys: for each channel, each group of 32 consecutive tokens shares (scale, zero) = ((max - min)/3, min);
values: for each token, each group of 32 consecutive channels shares them. code = round((x - zero)/scale) in [0, 3],
x_hat = code·scale + zero; a group holding a non-finite value gets a NaN scale, so NaN written into the cache comes
back NaN as from the bf16 cache (XLA's CPU min/max drop NaN and the codes are clipped: before, it came back finite).
Codes are packed 4 per byte with `oskvp.pack2`. The window is flushed in blocks of R
tokens (R a multiple of 32, so key groups never straddle a flush), with the same prefill split as OS-KVP:
n_comp = R·floor((len - 1)/R).

Layout per layer (every leaf batch-leading): codes_k, codes_v uint8 [B, K, S, H/4]; k_scale, k_zero f16
[B, K, S/32, H]; v_scale, v_zero f16 [B, K, S, H/32]; res_k, res_v bf16 [B, K, R, H]; n_comp, n_res int32 [B].

Decode attention: dense over the dequantized cache (implementation="xla", the default), or the split-K kernel
`pallas_kernels/kivi_decode_attention.py` on the codes themselves (implementation="pallas", H 64 or 128; interpret
mode off the GPU; not the default: slower than this XLA path on the H200 except at small batch and context,
`benchmarks/results/quantized_cache_decode.md`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from moe_jax import backend
from moe_jax.kv_cache import extend_token_by_token, masked_gqa_attention
from moe_jax.kv_quant.oskvp import pack2, unpack2
from moe_jax.kv_quant.oskvp_cache import prefill_split

GROUP = 32
F16_MAX = float(jnp.finfo(jnp.float16).max)


def _asym(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """2-bit asymmetric quantization along `axis` -> (codes uint8 like x, scale f16, zero f16 with axis removed); scale
  is NaN for a group with a non-finite value."""
  lo, hi = jnp.min(x, axis=axis), jnp.max(x, axis=axis)
  # Clipped to float16's range: beyond it (|x| > 65504) finite values saturate instead of turning into inf and NaN.
  scale = jnp.minimum(jnp.maximum(hi - lo, 1e-6 * jnp.maximum(jnp.abs(lo), jnp.abs(hi)) + 1e-30) / 3, F16_MAX)
  scale = jnp.where(jnp.all(jnp.isfinite(x), axis=axis), scale, jnp.nan)
  scale, zero = scale.astype(jnp.float16), jnp.clip(lo, -F16_MAX, F16_MAX).astype(jnp.float16)
  s, z = jnp.expand_dims(scale.astype(jnp.float32), axis), jnp.expand_dims(zero.astype(jnp.float32), axis)
  codes = jnp.clip(jnp.round((x - z) / s), 0, 3).astype(jnp.uint8)
  return codes, scale, zero


@functools.partial(jax.jit, static_argnames=("group",))
def quantize_keys(x: jax.Array, group: int = GROUP) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x f32 [..., T, H] (T a multiple of `group`) -> (packed [..., T, H/4], scale, zero f16 [..., T/group, H]). The
  cache uses group 32 (KIVI's); other sizes are for experiments (`benchmarks/oskvp_bits_split.py`)."""
  *lead, t, h = x.shape
  if group < 1 or t % group:
    raise ValueError(f"group={group} must divide the token count {t}")
  codes, scale, zero = _asym(x.reshape(*lead, t // group, group, h), axis=-2)
  return pack2(codes.reshape(*lead, t, h)), scale, zero


@functools.partial(jax.jit, static_argnames=("group",))
def quantize_values(x: jax.Array, group: int = GROUP) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x f32 [..., T, H] -> (packed [..., T, H/4], scale, zero f16 [..., T, H/g]), g = min(group, H) channels a group
  (the cache: 32)."""
  *lead, t, h = x.shape
  g = min(group, h)
  if g < 1 or h % g:
    raise ValueError(f"group={group} must divide the head dim {h}")
  codes, scale, zero = _asym(x.reshape(*lead, t, h // g, g), axis=-1)
  return pack2(codes.reshape(*lead, t, h)), scale, zero


@jax.jit
def dequantize_keys(packed, scale, zero) -> jax.Array:
  """(packed [..., T, H/4], scale, zero [..., T/g, H]) -> f32 [..., T, H]; the group g from the shapes."""
  codes = unpack2(packed).astype(jnp.float32)  # [..., T, H]
  g = codes.shape[-2] // scale.shape[-2]
  rep = lambda a: jnp.repeat(a.astype(jnp.float32), g, axis=-2)
  return codes * rep(scale) + rep(zero)


@jax.jit
def dequantize_values(packed, scale, zero) -> jax.Array:
  codes = unpack2(packed).astype(jnp.float32)
  g = codes.shape[-1] // scale.shape[-1]
  rep = lambda a: jnp.repeat(a.astype(jnp.float32), g, axis=-1)
  return codes * rep(scale) + rep(zero)


@struct.dataclass
class KIVILayerCache:
  """One layer's KIVI-2 cache; layout in the module docstring."""

  codes_k: jax.Array
  codes_v: jax.Array
  k_scale: jax.Array
  k_zero: jax.Array
  v_scale: jax.Array
  v_zero: jax.Array
  res_k: jax.Array
  res_v: jax.Array
  n_comp: jax.Array
  n_res: jax.Array
  implementation: str = struct.field(pytree_node=False, default="xla")
  capacity: int | None = struct.field(pytree_node=False, default=None)  # cache_len asked for (None: the storage)

  @property
  def max_len(self) -> int:
    """S, the positions the caller asked for (`cache_len`): a decode step past it gives NaN logits, as in every
    mode, although the storage is rounded up to a multiple of 32 (before, the guard fired only there)."""
    return self.storage_len if self.capacity is None else self.capacity

  @property
  def storage_len(self) -> int:
    """The positions stored: cache_len rounded up to a multiple of the group size."""
    return self.codes_k.shape[2]

  @property
  def kv_shape(self) -> tuple[int, int]:
    """(K, H): kv heads and head dim the cache holds."""
    return int(self.res_k.shape[1]), int(self.res_k.shape[3])

  @property
  def window(self) -> int:
    return self.res_k.shape[2]

  def nbytes(self) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self))

  def _flush(self) -> "KIVILayerCache":
    b, r = self.n_res.shape[0], self.window
    full = self.n_res == r
    ck, sk, zk = quantize_keys(self.res_k.astype(jnp.float32))  # [B, K, R, H/4], [B, K, R/32, H]
    cv, sv, zv = quantize_values(self.res_v.astype(jnp.float32))
    pos = jnp.where(full, self.n_comp, self.storage_len)  # past the storage: dropped
    rows = jnp.arange(b)[:, None]
    idx = pos[:, None] + jnp.arange(r)[None, :]
    gidx = pos[:, None] // GROUP + jnp.arange(r // GROUP)[None, :]

    def put(store, block, i):
      return store.at[rows, :, i].set(jnp.swapaxes(block, 1, 2), mode="drop")

    return self.replace(codes_k=put(self.codes_k, ck, idx), codes_v=put(self.codes_v, cv, idx),
                        k_scale=put(self.k_scale, sk, gidx), k_zero=put(self.k_zero, zk, gidx),
                        v_scale=put(self.v_scale, sv, idx), v_zero=put(self.v_zero, zv, idx),
                        n_comp=self.n_comp + jnp.where(full, r, 0), n_res=jnp.where(full, 0, self.n_res))

  @jax.jit
  def dequantized(self) -> tuple[jax.Array, jax.Array]:
    """(k_hat, v_hat) f32 [B, S, K, H] in token order: compressed [0, n_comp), window after it, zeros beyond."""
    s, r = self.storage_len, self.window
    rows = jnp.arange(self.n_comp.shape[0])[:, None]
    idx = jnp.clip(self.n_comp[:, None] + jnp.arange(r)[None, :], 0, s - 1)
    live = (jnp.arange(r)[None, :] < self.n_res[:, None])[:, None, :, None]
    comp_mask = (jnp.arange(s)[None, :] < self.n_comp[:, None])[:, None, :, None]

    def one(comp, res):
      comp = jnp.where(comp_mask, comp, 0.0)
      comp = comp.at[rows, :, idx].add(jnp.swapaxes(jnp.where(live, res.astype(jnp.float32), 0.0), 1, 2))
      return jnp.swapaxes(comp, 1, 2)  # [B, S, K, H]

    return (one(dequantize_keys(self.codes_k, self.k_scale, self.k_zero), self.res_k),
            one(dequantize_values(self.codes_v, self.v_scale, self.v_zero), self.res_v))

  def _step(self, q, k, v):
    """q [B, N, H], k, v [B, K, H] -> (o [B, N, H], cache)."""
    cache = jax.lax.cond(jnp.any(self.n_res >= self.window), lambda c: c._flush(), lambda c: c, self)
    rows = jnp.arange(q.shape[0])
    cache = cache.replace(res_k=cache.res_k.at[rows, :, cache.n_res].set(k.astype(cache.res_k.dtype)),
                          res_v=cache.res_v.at[rows, :, cache.n_res].set(v.astype(cache.res_v.dtype)),
                          n_res=cache.n_res + 1)
    if self.implementation == "pallas":
      # Imported here: the kernel lives in pallas_kernels/ and the XLA path must work without it.
      from pallas_kernels.kivi_decode_attention import kivi_decode_attention  # pylint: disable=g-import-not-at-top
      o = kivi_decode_attention(q, cache.codes_k, cache.k_scale, cache.k_zero, cache.codes_v, cache.v_scale,
                                cache.v_zero, cache.res_k, cache.res_v, cache.n_comp, cache.n_res,
                                interpret=backend.interpret_kernels())
      return o, cache
    kh, vh = cache.dequantized()
    visible = (jnp.arange(cache.storage_len)[None, :] < (cache.n_comp + cache.n_res)[:, None])[:, None, :]
    return masked_gqa_attention(q[:, None], kh, vh, visible)[:, 0], cache

  def extend(self, q, k, v, starts):
    """q: [B, T, N, H]; k, v: [B, T, K, H]; one token at a time (T static) -> ([B, T, N, H], cache)."""
    del starts
    return extend_token_by_token(KIVILayerCache._step, self, q, k, v)


@dataclasses.dataclass(frozen=True)
class KIVIMode:
  """KIVI-2. window: R, a multiple of 32. implementation: decode attention, "xla" (dense over the dequantized cache)
  or "pallas" (`kivi_decode_attention` on the codes)."""

  window: int = 128
  implementation: str = "xla"

  def __post_init__(self):
    if self.window < GROUP or self.window % GROUP:
      raise ValueError(f"window={self.window} must be a positive multiple of the group size {GROUP}")
    if self.implementation not in ("xla", "pallas"):
      raise ValueError(f"implementation={self.implementation!r} must be 'xla' or 'pallas'")

  def from_prefill(self, k, v, lengths, cache_len: int, *, layer: int) -> KIVILayerCache:
    """k, v: [B, T, K, H] -> KIVILayerCache of cache_len positions (stored rounded up to a multiple of 32)."""
    del layer
    b, t, kh, h = k.shape
    if h % 4 or (h > GROUP and h % GROUP):
      raise ValueError(f"head_dim={h} must be a multiple of 4 for 2-bit packing and, above {GROUP}, of the value "
                       f"group size {GROUP}")
    if cache_len < t:
      raise ValueError(f"cache_len={cache_len} is shorter than the prefill length {t}")
    s = -(-cache_len // GROUP) * GROUP
    n_comp, n_res = prefill_split(lengths, self.window)
    pad_t = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, s - t), (0, 0)))
    kt = pad_t(jnp.swapaxes(k, 1, 2).astype(jnp.float32))  # [B, K, S, H]
    vt = pad_t(jnp.swapaxes(v, 1, 2).astype(jnp.float32))
    ck, sk, zk = quantize_keys(kt)
    cv, sv, zv = quantize_values(vt)
    idx = jnp.clip(n_comp[:, None] + jnp.arange(self.window)[None, :], 0, t - 1)
    live = (jnp.arange(self.window)[None, :] < n_res[:, None])[:, None, :, None]
    res = lambda x: jnp.where(live, jnp.take_along_axis(x, idx[:, None, :, None], axis=2), 0.0).astype(jnp.bfloat16)
    return KIVILayerCache(codes_k=ck, codes_v=cv, k_scale=sk, k_zero=zk, v_scale=sv, v_zero=zv, res_k=res(kt),
                          res_v=res(vt), n_comp=n_comp, n_res=n_res, implementation=self.implementation,
                          capacity=cache_len)
