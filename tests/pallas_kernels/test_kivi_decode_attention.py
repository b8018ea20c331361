"""Split-K decode attention over the KIVI-2 cache (Triton interpret mode on CPU) vs its f32 reference, the reference
vs the cache's own XLA decode path, and the cache's pallas path through decode steps and a window flush."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from moe_jax.kv_cache import masked_gqa_attention
from moe_jax.kv_quant import KIVIMode, kivi
from pallas_kernels import kivi_decode_attention as kd


def _cache(seed, b, kh, s, r, h, n_comp, n_res):
  return _cache_arrays(seed, b, kh, s, r, h) + (jnp.asarray(n_comp, jnp.int32), jnp.asarray(n_res, jnp.int32))


@functools.partial(jax.jit, static_argnums=range(1, 6))
def _cache_arrays(seed, b, kh, s, r, h):
  """One program per shape (op by op, the draws and the quantizers compile a program per operation)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  kf = jax.random.normal(ks[0], (b, kh, s, h)) * 2.0
  vf = jax.random.normal(ks[1], (b, kh, s, h))
  ck, k_scale, k_zero = kivi.quantize_keys(kf)
  cv, v_scale, v_zero = kivi.quantize_values(vf)
  res_k = jax.random.normal(ks[2], (b, kh, r, h)).astype(jnp.bfloat16)
  res_v = jax.random.normal(ks[3], (b, kh, r, h)).astype(jnp.bfloat16)
  return ck, k_scale, k_zero, cv, v_scale, v_zero, res_k, res_v


# (K, G, H, capacity S, window R, n_comp, n_res, splits): H 64/128, G 1/4/8, empty stores and windows, splits
# with no tokens, a compressed store of 4096 (+ a window of 1: 4097 tokens).
CASES = [
    (2, 4, 128, 256, 128, [0, 64, 256], [1, 0, 77], 3),
    (1, 8, 64, 4096, 32, [4096], [1], 4),
    (2, 1, 64, 160, 64, [32, 128], [64, 5], 8),
    (1, 4, 128, 1024, 128, [992, 0], [127, 0], None),
]


@pytest.mark.parametrize("kh,g,h,s,r,n_comp,n_res,splits", CASES)
def test_matches_reference(kh, g, h, s, r, n_comp, n_res, splits):
  """Within 1e-2 of the largest output (bf16 q, tiles and p; measured 3e-3 to 6e-3); a row with no token is zero."""
  cache = _cache(h + g + s, len(n_comp), kh, s, r, h, n_comp, n_res)
  q = jax.random.normal(jax.random.key(s), (len(n_comp), kh * g, h))
  got = np.asarray(kd.kivi_decode_attention(q, *cache, num_splits=splits, interpret=True))
  want = np.asarray(kd.kivi_decode_attention_reference(q, *cache))
  live = (np.asarray(n_comp) + np.asarray(n_res)) > 0
  assert np.isfinite(got[live]).all()
  np.testing.assert_allclose(got[live], want[live], atol=1e-2 * np.abs(want[live]).max())
  assert not np.any(got[~live])


def test_reference_equals_the_cache_xla_path():
  """The reference is the cache's own decode (dense attention over `KIVILayerCache.dequantized`)."""
  ck, ksc, kz, cv, vsc, vz, rk, rv, nc, nr = _cache(1, 2, 2, 128, 32, 64, [64, 96], [9, 32])
  layer = kivi.KIVILayerCache(codes_k=ck, codes_v=cv, k_scale=ksc, k_zero=kz, v_scale=vsc, v_zero=vz, res_k=rk,
                              res_v=rv, n_comp=nc, n_res=nr)
  q = jax.random.normal(jax.random.key(2), (2, 8, 64))
  k_hat, v_hat = layer.dequantized()
  visible = (jnp.arange(128)[None, :] < (nc + nr)[:, None])[:, None, :]
  want = masked_gqa_attention(q[:, None], k_hat, v_hat, visible)[:, 0]
  got = kd.kivi_decode_attention(q, ck, ksc, kz, cv, vsc, vz, rk, rv, nc, nr, implementation="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_cache_pallas_path_tracks_xla_through_steps_and_a_flush():
  """KIVIMode(implementation="pallas") decodes like the XLA path, across a window flush (R = 32)."""
  b, kh, h = 2, 2, 64
  ks = jax.random.split(jax.random.key(7), 5)
  k, v = jax.random.normal(ks[0], (b, 60, kh, h)), jax.random.normal(ks[1], (b, 60, kh, h))
  lengths = jnp.array([60, 31])
  caches = {impl: KIVIMode(window=32, implementation=impl).from_prefill(k, v, lengths, 128, layer=0)
            for impl in ("xla", "pallas")}
  new_k, new_v = jax.random.normal(ks[2], (b, 6, kh, h)), jax.random.normal(ks[3], (b, 6, kh, h))
  qs = jax.random.normal(ks[4], (b, 6, 4 * kh, h))
  step = jax.jit(lambda c, q, kk, vv: c.extend(q, kk, vv, jnp.zeros(b, jnp.int32)))
  for t in range(6):
    outs = {}
    for impl in caches:
      outs[impl], caches[impl] = step(caches[impl], qs[:, t:t + 1], new_k[:, t:t + 1], new_v[:, t:t + 1])
    want = np.asarray(outs["xla"])
    np.testing.assert_allclose(np.asarray(outs["pallas"]), want, atol=1e-2 * np.abs(want).max())
  np.testing.assert_array_equal(caches["pallas"].n_comp, caches["xla"].n_comp)
  assert int(caches["pallas"].n_comp[1]) == 32  # row 1 flushed its window during the steps
  with pytest.raises(ValueError, match="implementation"):
    KIVIMode(implementation="cuda")


def test_lowers_to_triton_ir_for_hopper():
  for h in (64, 128):
    args = (jax.random.normal(jax.random.key(0), (2, 32, h)), *_cache(0, 2, 8, 512, 128, h, [256, 512], [3, 128]))
    assert lowers_to_triton_for_hopper(functools.partial(kd.kivi_decode_attention, interpret=False), *args)


def test_rejects_bad_arguments():
  cache = _cache(0, 2, 2, 64, 32, 128, [32, 64], [1, 2])
  q = jnp.zeros((2, 8, 128))
  call = functools.partial(kd.kivi_decode_attention, interpret=True)
  with pytest.raises(ValueError, match="head dim"):
    call(jnp.zeros((2, 8, 256)), *cache)
  with pytest.raises(ValueError, match="k_scale"):
    call(q, cache[0], cache[1][:, :, :1], *cache[2:])
  with pytest.raises(ValueError, match="kv heads"):
    call(q[:, :7], *cache)
  with pytest.raises(ValueError, match="n_comp"):
    call(q, *cache[:-2], cache[-2][:1], cache[-1])
  with pytest.raises(ValueError, match="implementation"):
    call(q, *cache, implementation="cuda")
  # Before: failed in Triton's lowering (a 24-row query tile), ran truncating float lengths (the reference does
  # not), failed inside Pallas' interpreter (an empty window) or numpy (num_splits=-1).
  with pytest.raises(ValueError, match="G = N / K = 24 query heads per kv head must be <= 16 or a power of two"):
    call(jnp.zeros((2, 48, 128)), *cache)
  with pytest.raises(ValueError, match="n_res must be an integer array"):
    call(q, *cache[:-1], cache[-1].astype(jnp.float32))
  with pytest.raises(ValueError, match="R=0: the kernel needs at least one slot"):
    call(q, *cache[:6], cache[6][:, :, :0], cache[7][:, :, :0], *cache[8:])
  with pytest.raises(ValueError, match="num_splits=-1 must be None or an int >= 1"):
    call(q, *cache, num_splits=-1)


def test_refuses_caches_the_triton_offsets_cannot_index():
  """codes of 64 × 8 × 131072 × 32 bytes (2^31) are refused by the kernel path at trace time, naming the input;
  the XLA path still takes them."""
  b, kh, s, h, r = 64, 8, 131072, 128, 128
  spec = jax.ShapeDtypeStruct
  args = (spec((b, 32, h), jnp.bfloat16), spec((b, kh, s, h // 4), jnp.uint8),
          *[spec((b, kh, s // 32, h), jnp.float32)] * 2, spec((b, kh, s, h // 4), jnp.uint8),
          *[spec((b, kh, s, h // 32), jnp.float32)] * 2, *[spec((b, kh, r, h), jnp.bfloat16)] * 2,
          *[spec((b,), jnp.int32)] * 2)
  with pytest.raises(ValueError, match=r"^codes_k \(64, 8, 131072, 32\) uint8 has 2147483648 >= 2\^31 elements"):
    jax.eval_shape(kd.kivi_decode_attention, *args)
  assert jax.eval_shape(functools.partial(kd.kivi_decode_attention, implementation="xla"), *args).shape == (b, 32, h)
