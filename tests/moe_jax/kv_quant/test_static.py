"""Static OS-KVP: per-(layer, head) calibration, orbax round trip, and decode through kv_cache="oskvp_static"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import decode
from moe_jax.kv_quant import static


def test_calibrate_save_load_install_and_decode(tiny_model, tiny_config, tmp_path):
  c = tiny_config
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, 256)
  mode = static.calibrate_model(tiny_model, tokens, jnp.array([64, 50]), window=16)
  h, kh, o = c.head_dim, c.n_kv_heads, 8
  assert mode.params_k.u.shape == (c.n_layers, kh, h, h) and mode.params_v.codebook.shape == (c.n_layers, kh, h, 4)
  assert mode.params_k.scale.shape == (c.n_layers, kh, o)
  np.testing.assert_allclose(jnp.einsum("LKHI,LKHJ->LKIJ", mode.params_k.u, mode.params_k.u),
                             jnp.broadcast_to(jnp.eye(h), (c.n_layers, kh, h, h)), atol=3e-5)
  static.save(str(tmp_path / "calib"), mode)
  loaded = static.load(str(tmp_path / "calib"))
  assert loaded.window == 16
  for a, b in zip(jax.tree_util.tree_leaves((mode.params_k, mode.params_v)),
                  jax.tree_util.tree_leaves((loaded.params_k, loaded.params_v))):
    np.testing.assert_array_equal(a, b)
  static.install(loaded, name="oskvp_static_test")
  prompt = tokens[:, :20]
  _, cache = decode.prefill(tiny_model, prompt, jnp.array([20, 5]), kv_cache="oskvp_static_test", cache_len=40)
  layer = cache.layers[1]
  # Every sequence of the batch carries the same calibrated basis of layer 1, even a 5-token prompt.
  np.testing.assert_array_equal(layer.u_k[0], loaded.params_k.u[1])
  np.testing.assert_array_equal(layer.u_k[1], loaded.params_k.u[1])
  np.testing.assert_array_equal(layer.n_comp, [16, 0])
  logits, cache = decode.decode_step(tiny_model, cache, jnp.array([1, 2]))
  ref_logits, _ = decode.decode_step(tiny_model, decode.prefill(tiny_model, prompt, jnp.array([20, 5]),
                                                                cache_len=40)[1], jnp.array([1, 2]))
  assert np.isfinite(np.asarray(logits)).all()
  # Row 1 (5 tokens, all in the window) is exact up to bf16; row 0 reads 16 compressed tokens.
  np.testing.assert_allclose(logits[1], ref_logits[1], atol=0.05 * float(jnp.abs(ref_logits[1]).max()))
  assert float(jnp.linalg.norm(logits[0] - ref_logits[0]) / jnp.linalg.norm(ref_logits[0])) < 0.25


def test_calibrate_model_names_bad_tokens_and_too_few_samples(tiny_model, tiny_config):
  bad = np.ones((1, 40), np.int32)
  bad[0, 7] = tiny_config.vocab_size
  with pytest.raises(ValueError, match=r"token id 264 at tokens\[0, 7\] is outside the vocabulary"):
    static.calibrate_model(tiny_model, bad)  # before: "layer 0 calibration keys contain non-finite values"
  with pytest.raises(ValueError, match="needs at least head_dim=32 tokens, got 1"):
    static.calibrate_model(tiny_model, np.ones((1, 1), np.int32))  # before: collapsed codebooks, no warning
  with pytest.raises(ValueError, match="window=0"):
    static.calibrate_model(tiny_model, np.ones((1, 40), np.int32), window=0)  # before: NaN logits at decode


def test_calibrate_layers_ignores_padding_of_ragged_rows():
  """Lengths [40, 10], padding set to 100: the parameters equal those fitted on the 50 valid rows alone (one row, no
  padding). Before, the samples were flattened time-major and the mask batch-major, so padding entered the fit (its
  fp8 scale ~90x the valid data's) and valid tokens were dropped."""
  rng = np.random.default_rng(0)
  b, t, k, h = 2, 40, 2, 16
  x = rng.normal(size=(b, t, k, h)).astype(np.float32) * np.linspace(0.2, 2.0, h).astype(np.float32)
  lengths = np.array([40, 10], np.int32)
  x[1, 10:] = 100.0
  valid = np.concatenate([x[0], x[1, :10]])[None]  # [1, 50, K, H]
  got = static.calibrate_layers([(jnp.asarray(x), jnp.asarray(x))], jnp.asarray(lengths))[0]
  want = static.calibrate_layers([(jnp.asarray(valid), jnp.asarray(valid))], jnp.asarray([50]))[0]
  for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w, np.float32), rtol=1e-4, atol=1e-5)


def test_a_calibration_for_other_attention_shapes_is_refused_and_the_cli_recalibrates(tiny_model, tiny_config):
  """Before, another model's calibration crashed inside a dot (other head_dim) or ran silently (fewer layers), and
  `setup_kv_cache` kept it."""
  from moe_jax import cli  # pylint: disable=g-import-not-at-top
  from moe_jax.kv_cache import get_kv_cache_mode  # pylint: disable=g-import-not-at-top
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 40), 0, 256)
  static.install(static.calibrate_model(tiny_model, tokens, window=16), name="oskvp_static_other")
  fewer = tiny_config.replace(n_layers=tiny_config.n_layers - 1)
  other = decode.init_model(fewer, seed=0)
  with pytest.raises(ValueError, match=rf"calibrated for {tiny_config.n_layers} layers x {tiny_config.n_kv_heads} kv "
                                       rf"heads x head_dim {tiny_config.head_dim}, the model has {fewer.n_layers} x"):
    decode.prefill(other, tokens[:, :8], jnp.array([8, 8]), kv_cache="oskvp_static_other", cache_len=16)
  mode = cli.setup_kv_cache(other, "oskvp_static_other", calib_windows=1, calib_seq_len=32, log=lambda _: None)
  assert mode is not None and mode.params_k.u.shape[0] == fewer.n_layers
  assert get_kv_cache_mode("oskvp_static_other", fewer) is mode
  logits, _ = decode.prefill(other, tokens[:, :8], jnp.array([8, 8]), kv_cache="oskvp_static_other", cache_len=16)
  assert np.isfinite(np.asarray(logits)).all()
