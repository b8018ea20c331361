"""The OS-KVP caches of all layers built at prefill with the layers' fits batched (`OSKVPMode.from_prefill_layers`,
`prefill_across_layers`, `prefill_fit_chunk`; `kv_cache.prefill_layers`), against one `from_prefill` per layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import decode
from moe_jax.kv_cache import KV_CACHE_MODES, get_kv_cache_mode, prefill_layers, register_kv_cache_mode
from moe_jax.kv_quant import OSKVPMode
from refit_checks import counting_fits, layer_kv  # pylint: disable=import-error  (this directory)

B, K, H, R, L, T = 3, 2, 32, 24, 3, 80
S = T + R
LEAVES = ("u_k", "u_v", "cb_k", "cb_v", "scale_k", "scale_v", "codes_k", "codes_v", "outl_k", "outl_v", "res_k",
          "res_v", "n_comp", "n_res", "refit")


def _layer_kv(layer: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  return layer_kv(layer, (B, T, K, H), dtype)


def _assert_same_caches(a, b) -> None:
  for name in LEAVES:
    np.testing.assert_array_equal(np.asarray(getattr(a, name), np.float32), np.asarray(getattr(b, name), np.float32),
                                  err_msg=name)


@pytest.mark.parametrize("chunk, calls", [(6, [6, 6]), (100, [9]), (3, [3] * L)])
def test_batched_prefill_fits_are_the_per_layer_fits(chunk, calls, monkeypatch):
  """L = 3 layers, B = 3 ragged prompts (one shorter than the window, fitted at prefill all the same: the batch has
  longer ones). Keys are longer than their fitting budget (max_fit_tokens 512 over 8 RoPE shifts: 64 of 80 tokens
  selected), values are not, so the two sides have their own lengths. Chunk 6: 2 layers a fit, two fits of 2 and
  1 + 1 padding layer (one program); 100: one fit of all; 3: one layer a fit. Every leaf of every layer equals the
  per-layer build's (the same fits on the CPU, batched differently), and the fits ran as counted."""
  lengths = jnp.array([T, 41, 10])
  kvs = [_layer_kv(i) for i in range(L)]
  fits = counting_fits(monkeypatch)
  base = OSKVPMode(window=R, max_fit_tokens=512, fit_implementation="xla")
  built = {}
  for across in (True, False):
    mode = dataclasses.replace(base, prefill_across_layers=across, prefill_fit_chunk=chunk)
    fits.clear()
    built[across] = jax.jit(lambda kvs, m=mode: prefill_layers(m, kvs, lengths, S))(kvs)
    jax.effects_barrier()
    assert fits == (calls if across else [B] * L), fits
  for a, b in zip(built[True], built[False]):
    _assert_same_caches(a, b)
  # The per-layer build is each layer's own `from_prefill` (the last layer: the one a chunk of 6 pads).
  one = jax.jit(lambda k, v: base.from_prefill(k, v, lengths, S, layer=0))(*kvs[-1])
  _assert_same_caches(built[True][-1], one)


def test_a_prefill_of_short_prompts_fits_no_layer(monkeypatch):
  """Prompts all shorter than the window: no layer is fitted (identity U, the flag to refit at the first flush set),
  as layer by layer."""
  lengths = jnp.array([R - 1, 5, 1])
  fits = counting_fits(monkeypatch)
  mode = OSKVPMode(window=R)
  caches = jax.jit(lambda kvs: mode.from_prefill_layers(kvs, lengths, S))([_layer_kv(i) for i in range(L)])
  jax.effects_barrier()
  assert not fits
  for cache in caches:
    np.testing.assert_array_equal(cache.u_k, jnp.broadcast_to(jnp.eye(H), (B, K, H, H)))
    assert bool(jnp.all(cache.refit))


def test_layers_of_different_dtypes_are_fitted_one_at_a_time(monkeypatch):
  """A layer whose keys and values are bf16 among f32 layers: every layer gets its own fit (no stacking of
  different dtypes), and each cache is that layer's `from_prefill`."""
  lengths = jnp.array([T, 60, 30])
  kvs = [_layer_kv(0), _layer_kv(1, jnp.bfloat16), _layer_kv(2)]
  fits = counting_fits(monkeypatch)
  mode = OSKVPMode(window=R, fit_implementation="xla")
  caches = jax.jit(lambda kvs: mode.from_prefill_layers(kvs, lengths, S))(kvs)
  jax.effects_barrier()
  assert fits == [B] * 3, fits
  for cache, (k, v) in zip(caches, kvs):
    _assert_same_caches(cache, jax.jit(lambda k, v: mode.from_prefill(k, v, lengths, S, layer=0))(k, v))


def test_modes_without_a_batched_build_go_layer_by_layer():
  """`prefill_layers` of a mode with no `from_prefill_layers` (bf16, KIVI) is its `from_prefill` per layer."""
  lengths = jnp.array([T, 41, 10])
  kvs = [_layer_kv(i) for i in range(2)]
  for name in ("bf16", "kivi2"):
    mode = get_kv_cache_mode(name)
    assert not hasattr(mode, "from_prefill_layers")
    for got, (k, v) in zip(prefill_layers(mode, kvs, lengths, S), kvs):
      want = mode.from_prefill(k, v, lengths, S, layer=0)
      jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
  assert prefill_layers(OSKVPMode(), [], lengths, S) == ()


def test_the_model_prefill_fits_its_layers_together(tiny_config, monkeypatch):
  """The tiny model's prefill (L = 2 layers) fits its layers in one call (two calls layer by layer) and then decodes
  the same logits over 6 greedy steps (1e-5 of the largest logit: the same fits)."""
  fits = counting_fits(monkeypatch)
  config = tiny_config
  assert config.n_layers == 2
  model = decode.init_model(config, seed=2)
  names = {True: "oskvp_test_prefill_across_layers", False: "oskvp_test_prefill_per_layer"}
  for across, name in names.items():
    register_kv_cache_mode(name, dataclasses.replace(get_kv_cache_mode("oskvp"), window=16, fit_implementation="xla",
                                                     prefill_across_layers=across))
  try:
    tokens = np.array(jax.random.randint(jax.random.PRNGKey(5), (2, 40), 1, config.vocab_size))
    lengths = np.array([40, 23])
    logits, calls = {}, {}
    for across, name in names.items():
      fits.clear()
      out, cache = decode.prefill(model, tokens, lengths, kv_cache=name, cache_len=64, last_only=True)
      jax.effects_barrier()
      calls[across] = list(fits)
      seq = [out]
      for _ in range(6):
        out, cache = decode.decode_step(model, cache, jnp.argmax(out, -1).astype(jnp.int32))
        seq.append(out)
      logits[across] = np.stack(seq)
    assert calls == {True: [4], False: [2, 2]}, calls
    np.testing.assert_allclose(logits[True], logits[False], atol=1e-5 * np.abs(logits[False]).max(), rtol=0)
  finally:
    for name in names.values():
      KV_CACHE_MODES.pop(name)


def test_an_empty_batch_builds_empty_caches():
  """B = 0 (before the batched fits, a division by the batch size): every layer's cache has no rows."""
  kvs = [tuple(x[:0] for x in _layer_kv(i)) for i in range(2)]
  caches = OSKVPMode(window=R).from_prefill_layers(kvs, jnp.zeros((0,), jnp.int32), S)
  assert [c.codes_k.shape[0] for c in caches] == [0, 0] and caches[0].u_k.shape == (0, K, H, H)


def test_prefill_fit_chunk_is_checked():
  with pytest.raises(ValueError, match="prefill_fit_chunk=0"):
    OSKVPMode(prefill_fit_chunk=0)
