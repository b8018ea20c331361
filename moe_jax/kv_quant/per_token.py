"""Per-token scaled 8-bit KV caches: `kv_cache="fp8"` (float8 e4m3) and `kv_cache="int8"` (symmetric int8).

Each token and kv head stores its H channels in 8 bits and one f32 scale: scale = amax_h |x_h| / qmax with
qmax = 448 (e4m3) or 127 (int8), floored so an all-zero token stays zero; a token with a non-finite channel gets a
NaN scale, so NaN written into the cache comes back NaN as from the bf16 cache (XLA's CPU max drops NaN, and int8
rounding maps it to 0: before, such a token came back finite and hid the NaN). Decode dequantizes the cache and runs the
dense masked attention of `moe_jax.kv_cache`, or, with implementation="pallas" and one new token per step, the
split-K kernel `pallas_kernels/per_token_decode_attention.py` on the 8-bit cache itself (interpret mode off the GPU;
not the default: slower than this XLA path on the H200, `benchmarks/results/quantized_cache_decode.md`).
Shapes: B batch, T new tokens, S cache length, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from moe_jax import backend
from moe_jax.kv_cache import masked_gqa_attention

_QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}


@functools.partial(jax.jit, static_argnames=("dtype",))
def quantize_per_token(x: jax.Array, dtype: str) -> tuple[jax.Array, jax.Array]:
  """x [..., H] -> (q [..., H] in dtype, scale f32 [...]); scale is NaN where a token has a non-finite entry."""
  qmax = _QMAX[dtype]
  x = x.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 1e-30) / qmax
  scale = jnp.where(jnp.all(jnp.isfinite(x), axis=-1), scale, jnp.nan)
  y = jnp.clip(x / scale[..., None], -qmax, qmax)
  if dtype == "int8":
    y = jnp.round(y)
  return y.astype(dtype), scale


@jax.jit
def dequantize_per_token(q: jax.Array, scale: jax.Array) -> jax.Array:
  return q.astype(jnp.float32) * scale[..., None]


@struct.dataclass
class PerTokenKV:
  """k, v: [B, S, K, H] in 8 bits; k_scale, v_scale: f32 [B, S, K]; implementation "xla" or "pallas" (decode)."""

  k: jax.Array
  v: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array
  implementation: str = struct.field(pytree_node=False, default="xla")

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

  @property
  def kv_shape(self) -> tuple[int, int]:
    """(K, H): kv heads and head dim the cache holds."""
    return int(self.k.shape[2]), int(self.k.shape[3])

  def nbytes(self) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self))

  @jax.jit
  def dequantized(self) -> tuple[jax.Array, jax.Array]:
    """(k_hat, v_hat) f32 [B, S, K, H]."""
    return dequantize_per_token(self.k, self.k_scale), dequantize_per_token(self.v, self.v_scale)

  def extend(self, q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array) -> tuple[jax.Array, "PerTokenKV"]:
    """q: [B, T, N, H]; k, v: [B, T, K, H]; starts int32 [B] -> ([B, T, N, H], cache); causal over the cache."""
    b, t = q.shape[:2]
    dtype = str(self.k.dtype)
    pos = starts[:, None] + jnp.arange(t)[None, :]  # [B, T]
    rows = jnp.arange(b)[:, None]
    qk, sk = quantize_per_token(k, dtype)
    qv, sv = quantize_per_token(v, dtype)
    new = self.replace(k=self.k.at[rows, pos].set(qk, mode="drop"), v=self.v.at[rows, pos].set(qv, mode="drop"),
                       k_scale=self.k_scale.at[rows, pos].set(sk, mode="drop"),
                       v_scale=self.v_scale.at[rows, pos].set(sv, mode="drop"))
    if self.implementation == "pallas" and t == 1:
      # Imported here: the kernel lives in pallas_kernels/ and the XLA path must work without it.
      from pallas_kernels.per_token_decode_attention import per_token_decode_attention  # pylint: disable=g-import-not-at-top
      o = per_token_decode_attention(q[:, 0], new.k, new.v, new.k_scale, new.v_scale, starts + 1,
                                     interpret=backend.interpret_kernels())
      return o[:, None], new
    visible = jnp.arange(self.max_len)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    kh, vh = new.dequantized()
    return masked_gqa_attention(q, kh, vh, visible), new


@dataclasses.dataclass(frozen=True)
class PerTokenMode:
  """Per-token 8-bit storage; dtype "float8_e4m3fn" or "int8". implementation: decode attention, "xla" (dense over
  the dequantized cache) or "pallas" (`per_token_decode_attention` on the 8-bit cache, one new token per step)."""

  dtype: str = "float8_e4m3fn"
  implementation: str = "xla"

  def __post_init__(self):
    if self.dtype not in _QMAX:
      raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(_QMAX)}")
    if self.implementation not in ("xla", "pallas"):
      raise ValueError(f"implementation={self.implementation!r} must be 'xla' or 'pallas'")

  def from_prefill(self, k, v, lengths, cache_len: int, *, layer: int) -> PerTokenKV:
    """k, v: [B, T, K, H] -> PerTokenKV with S = cache_len (padding positions are masked by length at decode)."""
    del lengths, layer
    t = k.shape[1]
    if cache_len < t:
      raise ValueError(f"cache_len={cache_len} is shorter than the prefill length {t}")
    qk, sk = quantize_per_token(k, self.dtype)
    qv, sv = quantize_per_token(v, self.dtype)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, cache_len - t)] + [(0, 0)] * (a.ndim - 2))
    return PerTokenKV(k=pad(qk), v=pad(qv), k_scale=pad(sk), v_scale=pad(sv), implementation=self.implementation)
