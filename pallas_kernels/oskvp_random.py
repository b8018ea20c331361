"""Random valid OS-KVP caches for tests and benchmarks (no quantizer needed).

Builds every argument of `oskvp_decode_attention` from a key: random orthogonal rotations (QR), uniform random
2-bit codes, sorted random codebooks (for the outlier channels constant rows, all four levels equal: the channel's
centre, as `oskvp.fit` stores it), fp8 outliers with positive scales,
and a bf16 residual window. `symmetric=True` draws codebook rows symmetric about a random centre, c -+ (a, b), as
`oskvp.fit(symmetric=True)` makes them (cb0 + cb3 = cb1 + cb2); `uniform_codebooks` draws equally spaced rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def random_oskvp_inputs(key, *, batch: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
                        window: int = 128, outliers: int = 8, n_comp=None, n_res=None, q_dtype=jnp.bfloat16,
                        symmetric: bool = False, key_bits: int = 2):
  """Returns the 15 positional arguments of `oskvp_decode_attention` as a tuple.

  n_comp / n_res: int or sequence of length `batch` (default: full store, full window).
  key_bits=3: 8-level key codebooks, and hi_k uint8 [B, K, S, H/8] appended as a 16th element.
  """
  if key_bits not in (2, 3):
    raise ValueError(f"{key_bits=} must be 2 or 3")
  lens = lambda v, full: jnp.asarray(np.broadcast_to(np.asarray(full if v is None else v, np.int32), (batch,)))
  out = _random_cache(key, batch, heads, kv_heads, head_dim, capacity, window, outliers, jnp.dtype(q_dtype),
                      symmetric, key_bits)
  return out[:13] + (lens(n_comp, capacity), lens(n_res, window)) + out[13:]


def uniform_codebooks(key, shape: tuple[int, ...], outliers: int = 0) -> jax.Array:
  """Random uniform codebooks f32 [*shape, 4], cb[c] = c0 + d·c (c0 ~ N(-1.5, 1), d ~ U(0.3, 1.2)), as
  `oskvp.fit(uniform=True)` makes them; the first `outliers` rows of the last axis of shape (the channels) constant,
  d = 0 (an outlier channel's centre)."""
  k0, k1 = jax.random.split(key)
  c0 = jax.random.normal(k0, shape) - 1.5
  d = jax.random.uniform(k1, shape, minval=0.3, maxval=1.2)
  d = jnp.where(jnp.arange(shape[-1]) < outliers, 0.0, d)
  return c0[..., None] + d[..., None] * jnp.arange(4.0)


def symmetrize(cb):
  """Sorted rows [..., L] -> rows symmetric about their mean, level i = mean + (cb[i] - cb[L-1-i]) / 2 (for 4 levels
  c -+ (a, b) with the rows' mean half-gaps (a, b))."""
  return cb.mean(axis=-1, keepdims=True) + 0.5 * (cb - cb[..., ::-1])


@functools.partial(jax.jit, static_argnums=range(1, 11))
def _random_cache(key, b, heads, k, h, s, r, o, q_dtype, symmetric, key_bits):
  """One compiled program (eager op-by-op generation costs seconds of compiles on CPU)."""
  ks = jax.random.split(key, 12)
  q = jax.random.normal(ks[0], (b, heads, h), jnp.float32).astype(q_dtype)

  def orth(kk):
    a = jax.random.normal(kk, (b, k, h, h), jnp.float32)
    return jnp.linalg.qr(a)[0]

  def codebook(kk, levels=4):
    cb = jnp.sort(jax.random.normal(kk, (b, k, h, levels), jnp.float32), axis=-1)
    cb = symmetrize(cb) if symmetric else cb
    return cb.at[:, :, :o].set(cb[:, :, :o, :1])  # outlier channels: constant rows (their centres)

  def codes(kk):
    return jax.random.randint(kk, (b, k, s, h // 4), 0, 256, jnp.int32).astype(jnp.uint8)

  def outl(kk):
    return (jax.random.normal(kk, (b, k, s, o), jnp.float32) * 4).astype(jnp.float8_e4m3fn)

  def scale(kk):
    return jax.random.uniform(kk, (b, k, o), jnp.float32, 0.5, 2.0)

  def res(kk):
    return jax.random.normal(kk, (b, k, r, h), jnp.float32).astype(jnp.bfloat16)

  out = (q, codes(ks[1]), outl(ks[2]), scale(ks[3]), codebook(ks[4], 1 << key_bits), codes(ks[5]), outl(ks[6]),
         scale(ks[7]), codebook(ks[8]), orth(ks[9]), orth(ks[10]), res(ks[11]), res(jax.random.fold_in(ks[11], 1)))
  if key_bits == 3:
    hi = jax.random.randint(jax.random.fold_in(ks[1], 3), (b, k, s, h // 8), 0, 256, jnp.int32).astype(jnp.uint8)
    out += (hi,)
  return out


def random_oskvp_inputs_host(seed: int, *, batch: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
                             window: int = 128, outliers: int = 8, n_comp=None, n_res=None, q_dtype=jnp.bfloat16,
                             symmetric: bool = False, key_bits: int = 2):
  """Same distribution as `random_oskvp_inputs`, drawn with numpy on the host: no XLA compile at all, which is
  what small CPU tests want (compiling the jitted generator costs ~15 s of CPU per shape).

  key_bits=3: 3-bit keys (`OSKVPMode(key_bits=3)`): cb_k has 8 sorted levels, and a 16th element, hi_k uint8
  [B, K, S, H/8] (uniform random third code bits), follows the 15 arguments.
  """
  if key_bits not in (2, 3):
    raise ValueError(f"{key_bits=} must be 2 or 3")
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  b, k, h, s, r, o = batch, kv_heads, head_dim, capacity, window, outliers
  f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)

  def codebook(levels=4):
    cb = np.sort(f32(b, k, h, levels), axis=-1)
    cb = symmetrize(cb) if symmetric else cb
    cb[:, :, :o] = cb[:, :, :o, :1]  # outlier channels: constant rows (their centres)
    return cb

  codes = lambda: rng.integers(0, 256, (b, k, s, h // 4), dtype=np.uint8)
  outl = lambda: (f32(b, k, s, o) * 4).astype(ml_dtypes.float8_e4m3fn)
  scale = lambda: rng.uniform(0.5, 2.0, (b, k, o)).astype(np.float32)
  orth = lambda: np.linalg.qr(f32(b, k, h, h))[0].astype(np.float32)
  res = lambda: f32(b, k, r, h).astype(ml_dtypes.bfloat16)
  lens = lambda v, full: np.broadcast_to(np.asarray(full if v is None else v, np.int32), (b,)).copy()
  arrays = (f32(b, heads, h).astype(q_dtype), codes(), outl(), scale(), codebook(1 << key_bits), codes(), outl(),
            scale(), codebook(), orth(), orth(), res(), res(), lens(n_comp, s), lens(n_res, r))
  if key_bits == 3:
    arrays += (rng.integers(0, 256, (b, k, s, h // 8), dtype=np.uint8),)
  return tuple(jnp.asarray(x) for x in arrays)


@functools.partial(jax.jit, static_argnames=("batch", "kv_heads", "splits", "group", "head_dim", "window",
                                             "empty_split"))
def random_epilogue_inputs(key, n_res, *, batch: int, kv_heads: int, splits: int, group: int = 4, head_dim: int = 128,
                           window: int = 128, empty_split: bool = True) -> tuple:
  """Random arguments of `oskvp_uniform_epilogue.rotating_epilogue` (the first ten are `epilogue`'s), one program:
  the core's per-split outputs acc f32 [B, K, S, H, 8] (0..3000), ml [B, K, S, 32] (m ~ 4·N(0, 1), l in [1, 1000];
  split 0 saw no token, m = MASKED and l = 0, unless empty_split=False), acco [B, K, S, 2, 8, 8] (two parts, as
  "fp8_stacked" leaves them); q_rot f32 [B, K, G, H], qc [B, K, 8], value codebooks cb [B, K, H, 4] (c0 ~ N(0, 1),
  step 0.5), scale_v 0.05, a bf16 window res_k, res_v [B, K, R, H] with n_res int32 [B] tokens (given), and an
  orthogonal U_v f32 [B, K, H, H]."""
  from pallas_kernels.oskvp_decode_core_mgpu import MASKED  # pylint: disable=g-import-not-at-top
  b, kh, h = batch, kv_heads, head_dim
  ks = jax.random.split(key, 8)
  acc = jax.random.uniform(ks[0], (b, kh, splits, h, 8)) * 3000.0
  m = jax.random.normal(ks[1], (b, kh, splits, 8)) * 4
  if empty_split:
    m = m.at[:, :, 0].set(MASKED)
  l = jnp.where(m > 0.5 * MASKED, jax.random.uniform(ks[2], m.shape, minval=1.0, maxval=1000.0), 0.0)
  ml = jnp.concatenate([m, l, jnp.zeros((b, kh, splits, 16))], axis=-1)
  acco = jax.random.normal(ks[3], (b, kh, splits, 2, 8, 8)) * 100.0
  q_rot = jax.random.normal(ks[4], (b, kh, group, h))
  qc = jax.random.normal(ks[5], (b, kh, 8))
  cb = jax.random.normal(ks[6], (b, kh, h))[..., None] + 0.5 * jnp.arange(4.0)
  res = jax.random.normal(ks[7], (2, b, kh, window, h)).astype(jnp.bfloat16)
  u_v = jnp.linalg.qr(jax.random.normal(jax.random.fold_in(key, 8), (b, kh, h, h)))[0]
  return (acc, ml, acco, q_rot, qc, cb, jnp.full((b, kh, 8), 0.05), res[0], res[1], n_res.astype(jnp.int32), u_v)
