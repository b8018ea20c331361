"""The references' masked softmax: invisible slots read as nothing (NaN / inf stored there does not reach the
output, as in the kernels) and a row with no visible slot gives zeros, as the per-token and KIVI docstrings say."""

import jax.numpy as jnp
import numpy as np

from moe_jax.kv_quant import kivi
from pallas_kernels import masked_softmax
from pallas_kernels.kivi_decode_attention import kivi_decode_attention_reference
from pallas_kernels.oskvp_decode_attention import oskvp_decode_attention_reference
from pallas_kernels.oskvp_random import random_oskvp_inputs_host
from pallas_kernels.per_token_decode_attention import per_token_decode_attention_reference


def test_masked_probs():
  s = jnp.array([[1.0, 2.0, jnp.nan, 3.0], [5.0, 1.0, 2.0, 0.0]])
  vis = jnp.array([[True, True, False, False], [False, False, False, False]])
  p = np.asarray(masked_softmax.masked_probs(s, vis))
  np.testing.assert_allclose(p[0], [1 / (1 + np.e), np.e / (1 + np.e), 0, 0], rtol=1e-6)
  np.testing.assert_array_equal(p[1], np.zeros(4))


def test_references_ignore_invisible_slots_and_give_zeros_for_empty_rows():
  """Before: a NaN value scale at a slot past the row's length made the per-token reference's row NaN (0 · NaN), a
  NaN in the OS-KVP window past n_res likewise, and empty rows were NaN (0 / 0) where the docstrings say zeros."""
  rng = np.random.default_rng(0)
  b, s, kh, g, h = 2, 32, 1, 2, 64
  q = jnp.asarray(rng.standard_normal((b, kh * g, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, kh, h)) * 3).astype(jnp.int8)
  scale = jnp.full((b, s, kh), 0.3, jnp.float32)
  lengths = jnp.array([5, 5], jnp.int32)
  clean = per_token_decode_attention_reference(q, k, k, scale, scale, lengths)
  poisoned = per_token_decode_attention_reference(q, k, k, scale, scale.at[0, 20].set(jnp.nan), lengths)
  np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))
  empty = per_token_decode_attention_reference(q, k, k, scale, scale, jnp.array([0, 5], jnp.int32))
  np.testing.assert_array_equal(np.asarray(empty[0]), np.zeros((kh * g, h)))
  np.testing.assert_array_equal(np.asarray(empty[1]), np.asarray(clean[1]))

  x = jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32)
  ck, sk, zk = kivi.quantize_keys(x)
  cv, sv, zv = kivi.quantize_values(x)
  res = jnp.zeros((b, kh, 32, h), jnp.bfloat16)
  out = kivi_decode_attention_reference(q, ck, sk, zk, cv, sv, zv, res, res, jnp.array([0, 32]), jnp.array([0, 1]))
  np.testing.assert_array_equal(np.asarray(out[0]), np.zeros((kh * g, h)))
  assert np.isfinite(np.asarray(out[1])).all()

  args = list(random_oskvp_inputs_host(0, batch=1, heads=2, kv_heads=1, head_dim=64, capacity=32, window=16,
                                       n_comp=[16], n_res=[5]))
  clean = oskvp_decode_attention_reference(*args)
  args[12] = args[12].at[0, 0, 10].set(jnp.nan)  # res_v slot 10, past n_res = 5
  np.testing.assert_array_equal(np.asarray(oskvp_decode_attention_reference(*args), np.float32),
                                np.asarray(clean, np.float32))
