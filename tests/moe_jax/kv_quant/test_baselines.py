"""Baseline compressed caches (fp8, int8, kivi2): error bounds, layout, flushes, and the registered names."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.kv_cache import get_kv_cache_mode, masked_gqa_attention
from moe_jax.kv_quant import KIVIMode, kivi, per_token

B, K, H = 2, 2, 64


@functools.partial(jax.jit, static_argnums=(0, 1))
def _normals(seed, shapes):
  """Standard normal draws of `shapes` from the splits of PRNGKey(seed) (one program)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return [jax.random.normal(key, shape) for key, shape in zip(ks, shapes)]


def test_modes_are_registered():
  for name in ("fp8", "int8", "kivi2", "oskvp", "oskvp3", "oskvp_k3v2", "oskvp_k3v2_sym", "oskvp_static"):
    assert get_kv_cache_mode(name) is not None
  assert get_kv_cache_mode("kivi2").window == 128
  assert get_kv_cache_mode("oskvp3").bits == 3
  assert (get_kv_cache_mode("oskvp_k3v2").k_bits, get_kv_cache_mode("oskvp_k3v2").bits) == (3, 2)
  assert get_kv_cache_mode("oskvp_k3v2_sym").k_bits == 3 and get_kv_cache_mode("oskvp_k3v2_sym").symmetric
  with pytest.raises(ValueError, match="not calibrated"):
    get_kv_cache_mode("oskvp_static").from_prefill(jnp.zeros((1, 4, K, H)), jnp.zeros((1, 4, K, H)),
                                                   jnp.array([4]), 8, layer=0)


@pytest.mark.parametrize("dtype,rel", [("int8", 0.5 / 127), ("float8_e4m3fn", 2.0**-4)])
def test_per_token_error_bound(dtype, rel):
  """|x - x_hat| <= amax·rel for int8 (half a step), <= |x|·2^-4 + subnormal step for e4m3."""
  x = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(0), (B, 16, K, H)) * jnp.exp(
      jax.random.normal(jax.random.PRNGKey(1), (B, 16, K, 1))))()
  q, s = per_token.quantize_per_token(x, dtype)
  assert q.dtype == jnp.dtype(dtype) and s.shape == (B, 16, K)
  err = np.abs(np.asarray(per_token.dequantize_per_token(q, s) - x))
  amax = np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True)
  if dtype == "int8":
    assert np.all(err <= rel * amax * 1.0001)
  else:
    assert np.all(err <= rel * np.abs(np.asarray(x)) + amax / 448 * 2.0**-9 + 1e-7)


def test_kivi_quantizers_error_bounds_and_grouping():
  x = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(2), (B, K, 64, H)) * jnp.ones(H).at[7].set(20.0) + 3.0)()
  packed, scale, zero = kivi.quantize_keys(x)
  assert packed.shape == (B, K, 64, H // 4) and scale.shape == (B, K, 2, H) and scale.dtype == jnp.float16
  x_hat = kivi.dequantize_keys(packed, scale, zero)
  step = jnp.repeat(scale.astype(jnp.float32), kivi.GROUP, axis=-2)
  # Half a step, plus float16 rounding of scale and zero point.
  assert np.all(np.abs(np.asarray(x_hat - x)) <= 0.5 * np.asarray(step) + 2e-3 * np.abs(np.asarray(x)) + 1e-3)
  # Per-channel key groups: the outlier channel does not widen the other channels' steps.
  assert float(scale[..., 0].astype(jnp.float32).max()) < 0.2 * float(scale[..., 7].astype(jnp.float32).min())
  packed, scale, zero = kivi.quantize_values(x)
  assert scale.shape == (B, K, 64, H // 32)
  x_hat = kivi.dequantize_values(packed, scale, zero)
  step = jnp.repeat(scale.astype(jnp.float32), 32, axis=-1)
  assert np.all(np.abs(np.asarray(x_hat - x)) <= 0.5 * np.asarray(step) + 2e-3 * np.abs(np.asarray(x)) + 1e-3)


def test_kivi_cache_flushes_and_attends_over_what_it_stores():
  k, v, new_k, new_v, qs = _normals(3, ((B, 70, K, H),) * 2 + ((B, 30, K, H),) * 2 + ((B, 30, 2 * K, H),))
  lengths = jnp.array([70, 33])
  cache = jax.jit(lambda k, v: KIVIMode(window=32).from_prefill(k, v, lengths, 100, layer=0))(k, v)
  np.testing.assert_array_equal(cache.n_comp, [64, 32])
  np.testing.assert_array_equal(cache.n_res, [6, 1])
  assert cache.codes_k.shape == (B, K, 128, H // 4) and cache.storage_len == 128 and cache.max_len == 100
  step = jax.jit(lambda c, q, k, v: c.extend(q, k, v, jnp.zeros(B, jnp.int32)))
  prefilled, outs = cache, []
  for t in range(30):
    o, cache = step(cache, qs[:, t:t + 1], new_k[:, t:t + 1], new_v[:, t:t + 1])
    outs.append(o)
  # The 30 tokens as one extend (T = 30, a scan after the first token): the same outputs and cache.
  o_all, at_once = step(prefilled, qs, new_k, new_v)
  np.testing.assert_allclose(o_all, jnp.concatenate(outs, axis=1), rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(at_once, cache, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(cache.n_comp + cache.n_res, lengths + 30)
  np.testing.assert_array_equal(cache.n_comp, [96, 32])
  k_hat, v_hat = cache.dequantized()
  visible = (jnp.arange(128)[None, :] < (lengths + 30)[:, None])[:, None, :]
  np.testing.assert_allclose(o, masked_gqa_attention(qs[:, -1:], k_hat, v_hat, visible), rtol=1e-4, atol=1e-4)
  # Row 0 tokens 64..95 were flushed at decode: quantized per channel as one group of 32.
  seq = jnp.concatenate([k[0], new_k[0]], axis=0)  # [100, K, H]
  blk = jnp.swapaxes(seq[64:96], 0, 1).astype(jnp.bfloat16).astype(jnp.float32)  # [K, 32, H]
  np.testing.assert_allclose(jnp.swapaxes(k_hat[0, 64:96], 0, 1), kivi.dequantize_keys(*kivi.quantize_keys(blk)),
                             atol=1e-3)
  # The window (tokens 96..99) is exact up to bf16.
  np.testing.assert_allclose(k_hat[0, 96:100], seq[96:100], atol=0.02)
  # No tokens: [B, 0, N, H] in q's dtype and the cache as it was (before, jnp.stack of nothing raised).
  o0, same = cache.extend(qs[:, :0].astype(jnp.bfloat16), new_k[:, :0], new_v[:, :0], jnp.zeros(B, jnp.int32))
  assert o0.shape == (B, 0, 2 * K, H) and o0.dtype == jnp.bfloat16 and same is cache


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_per_token_pallas_decode_tracks_the_xla_path(dtype):
  """implementation="pallas" (the split-K kernel, interpret mode here) decodes like the dense XLA path over the same
  stored cache: caches equal, outputs within 1e-2 of their scale (bf16 q and p·v_scale in the kernel)."""
  k, v, new_k, new_v, qs = _normals(5, ((B, 40, K, H),) * 2 + ((B, 3, K, H),) * 2 + ((B, 3, 4 * K, H),))
  lengths = jnp.array([40, 7])
  caches = {impl: jax.jit(per_token.PerTokenMode(dtype, implementation=impl).from_prefill, static_argnums=3,
                          static_argnames="layer")(k, v, lengths, 48, layer=0)
            for impl in ("xla", "pallas")}
  step = jax.jit(lambda c, q, kk, vv, starts: c.extend(q, kk, vv, starts))
  for t in range(3):
    outs = {}
    for impl, cache in caches.items():
      outs[impl], caches[impl] = step(cache, qs[:, t:t + 1], new_k[:, t:t + 1], new_v[:, t:t + 1], lengths + t)
    want = np.asarray(outs["xla"])
    np.testing.assert_allclose(np.asarray(outs["pallas"]), want, atol=1e-2 * np.abs(want).max())
  np.testing.assert_array_equal(np.asarray(caches["pallas"].k, np.float32), np.asarray(caches["xla"].k, np.float32))
  with pytest.raises(ValueError, match="implementation"):
    per_token.PerTokenMode(dtype, implementation="cuda")


def test_kivi_saturates_beyond_the_float16_range_instead_of_nan():
  x = jax.random.normal(jax.random.key(3), (64, 32)) * 1e5  # |x| up to ~4e5 > 65504
  for quantize, dequantize in ((kivi.quantize_keys, kivi.dequantize_keys),
                               (kivi.quantize_values, kivi.dequantize_values)):
    x_hat = dequantize(*quantize(x))  # before: inf scales, NaN keys and values
    assert np.isfinite(np.asarray(x_hat)).all()
  small = jnp.clip(x, -6e4, 6e4) / 4  # within range: unchanged behaviour, the usual 2-bit error bound
  k_hat = kivi.dequantize_keys(*kivi.quantize_keys(small))
  assert float(jnp.max(jnp.abs(k_hat - small))) <= float(jnp.max(small) - jnp.min(small)) / 6 * 1.01


def test_kivi_names_a_head_dim_its_value_groups_do_not_divide():
  k = jnp.zeros((1, 4, 1, 48))
  with pytest.raises(ValueError, match="head_dim=48 must be a multiple of 4 .* of the value group size 32"):
    KIVIMode(window=32).from_prefill(k, k, jnp.array([4]), 32, layer=0)  # before: a reshape TypeError


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name", ["fp8", "int8", "kivi2"])
def test_prefill_nan_comes_back_nan_like_the_bf16_cache(name, impl):
  """A NaN key or value written at prefill (row 0, kv head 0, token 3, in KIVI's compressed part) makes that kv
  head's decode output NaN, as the bf16 cache's does, and leaves the other heads and rows finite. Before, the int8
  and KIVI quantizers turned it into finite numbers (XLA's CPU max/min drop NaN, rounding and clipping do the rest)
  and a NaN-producing model looked fine under them."""
  k, v, new, q = _normals(7, ((B, 40, K, H),) * 2 + ((B, 1, K, H), (B, 1, 2 * K, H)))
  lengths = jnp.array([40, 40])
  mode = (KIVIMode(window=32, implementation=impl) if name == "kivi2"
          else per_token.PerTokenMode(get_kv_cache_mode(name).dtype, implementation=impl))
  prefill = jax.jit(lambda k, v: mode.from_prefill(k, v, lengths, 64, layer=0))
  step = jax.jit(lambda c, q, kk, vv: c.extend(q, kk, vv, lengths))
  for kk, vv in ((k.at[0, 3, 0, 5].set(jnp.nan), v), (k, v.at[0, 3, 0, 5].set(jnp.nan))):
    o, _ = step(prefill(kk, vv), q, new, new)
    nan = np.isnan(np.asarray(o, np.float32)).any(-1)[:, 0]  # [B, N]
    np.testing.assert_array_equal(nan, [[True, True, False, False], [False] * 4])
