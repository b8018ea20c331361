"""Random valid OS-KVP caches for tests and benchmarks (no quantizer needed).

Builds every argument of `oskvp_decode_attention` from a key: random orthogonal rotations (QR), uniform random
2-bit codes, sorted random codebooks (zero rows for the outlier channels), fp8 outliers with positive scales,
and a bf16 residual window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def random_oskvp_inputs(key, *, batch: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
                        window: int = 128, outliers: int = 8, n_comp=None, n_res=None, q_dtype=jnp.bfloat16):
  """Returns the 15 positional arguments of `oskvp_decode_attention` as a tuple.

  n_comp / n_res: int or sequence of length `batch` (default: full store, full window).
  """
  b, k, h, s, r, o = batch, kv_heads, head_dim, capacity, window, outliers
  ks = jax.random.split(key, 12)
  q = jax.random.normal(ks[0], (b, heads, h), jnp.float32).astype(q_dtype)

  def orth(kk):
    a = jax.random.normal(kk, (b, k, h, h), jnp.float32)
    return jnp.linalg.qr(a)[0]

  def codebook(kk):
    cb = jnp.sort(jax.random.normal(kk, (b, k, h, 4), jnp.float32), axis=-1)
    return cb.at[:, :, :o].set(0.0)

  def codes(kk):
    return jax.random.randint(kk, (b, k, s, h // 4), 0, 256, jnp.int32).astype(jnp.uint8)

  def outl(kk):
    return (jax.random.normal(kk, (b, k, s, o), jnp.float32) * 4).astype(jnp.float8_e4m3fn)

  def scale(kk):
    return jax.random.uniform(kk, (b, k, o), jnp.float32, 0.5, 2.0)

  def res(kk):
    return jax.random.normal(kk, (b, k, r, h), jnp.float32).astype(jnp.bfloat16)

  lens = lambda v, full: jnp.broadcast_to(jnp.asarray(full if v is None else v, jnp.int32), (b,))
  return (q, codes(ks[1]), outl(ks[2]), scale(ks[3]), codebook(ks[4]), codes(ks[5]), outl(ks[6]), scale(ks[7]),
          codebook(ks[8]), orth(ks[9]), orth(ks[10]), res(ks[11]), res(jax.random.fold_in(ks[11], 1)),
          lens(n_comp, s), lens(n_res, r))
