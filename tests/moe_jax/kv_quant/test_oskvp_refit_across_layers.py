"""The OS-KVP refits at the first flush of a decode step, done for all layers at once before the first layer runs
(`oskvp_cache.refit_before_step`, `OSKVPMode.refit_across_layers`), against the per-layer refits inside each flush."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import decode
from moe_jax.kv_cache import KV_CACHE_MODES, before_step, get_kv_cache_mode, register_kv_cache_mode
from moe_jax.kv_quant import OSKVPMode
from moe_jax.kv_quant.oskvp_cache import refit_before_step
from refit_checks import assert_same_refits, counting_fits, layer_kv  # pylint: disable=import-error  (here)

B, K, G, H, R, S, L = 5, 2, 2, 32, 24, 96, 3


def _layer_kv(layer: int, t: int) -> tuple[jax.Array, jax.Array]:
  return layer_kv(layer, (B, t, K, H))


@pytest.mark.parametrize("chunk", [1, 8])
def test_refits_before_the_step_are_the_per_layer_refits(chunk, monkeypatch):
  """L = 3 layers, a long prompt (row 0) and four inside the window: three rows flush at step 2 and one at step 4.
  Layer 1 does not flag row 2 and layer 0 not row 3 (their flags cleared after prefill), so those layers keep those
  rows' prefill fits while the other layers refit them. Refitting before the step (`refit_before_step`, then each
  layer's `extend`) gives the caches and outputs of the per-layer refits, with one fit call per chunk for all layers
  (chunk 8: chunks of 8 // L = 2 rows; chunk 1: one call of L rows per flushing row) instead of one per layer and
  chunk, and the layers' own flushes trace no refit then."""
  calls = counting_fits(monkeypatch)
  lengths = jnp.array([60, R - 1, R - 1, R - 1, R - 3])
  steps = 5
  kvs = [_layer_kv(i, 60 + steps) for i in range(L)]
  q = jax.random.normal(jax.random.PRNGKey(3), (B, steps, K * G, H))
  runs, fits = {}, {}
  for across in (True, False):
    mode = OSKVPMode(window=R, refit_chunk=chunk, refit_across_layers=across)
    layers = [jax.jit(lambda k, v: mode.from_prefill(k, v, lengths, S, layer=0))(k[:, :60], v[:, :60])
              for k, v in kvs]
    layers[1] = layers[1].replace(refit=layers[1].refit.at[2].set(False))
    layers[0] = layers[0].replace(refit=layers[0].refit.at[3].set(False))  # row 3: flagged in later layers only
    u_kept, u_prefill = np.asarray(layers[1].u_k[2]), np.asarray(layers[0].u_k[2])
    u3 = [np.asarray(layer.u_k[3]) for layer in layers]

    @jax.jit
    def step(layers, i):
      layers = before_step(tuple(layers))
      outs = []
      for layer, (k, v) in zip(layers, kvs):
        idx = (lengths + i)[:, None, None, None]
        outs.append(layer.extend(q[:, i][:, None], jnp.take_along_axis(k, idx, 1), jnp.take_along_axis(v, idx, 1),
                                 lengths + i))
      return [o for o, _ in outs], [c for _, c in outs]

    # The layers' own flushes do not trace a refit when the refits come before the step (`refits_done`): eigh
    # appears in the chunk and single-row fits once for all layers, against once per layer.
    eighs = str(jax.make_jaxpr(step)(layers, 0)).count("name=eigh")  # calls of the jitted eigh
    assert eighs == (1 if chunk == 1 else 2) * (1 if across else L), eighs
    calls.clear()
    outs = []
    for i in range(steps):
      o, layers = step(layers, i)
      outs.append(o)
    jax.effects_barrier()
    fits[across] = list(calls)
    np.testing.assert_array_equal(layers[1].u_k[2], u_kept)  # not flagged in layer 1: its prefill fit stays
    assert not np.allclose(layers[0].u_k[2], u_prefill, atol=1e-3)  # flagged in layer 0: refitted
    np.testing.assert_array_equal(layers[0].u_k[3], u3[0])  # row 3 is not flagged in layer 0 ...
    assert not any(np.allclose(layers[i].u_k[3], u3[i], atol=1e-3) for i in (1, 2))  # ... but in layers 1 and 2
    runs[across] = (layers, outs)
  for a, b in zip(runs[True][0], runs[False][0]):
    assert_same_refits(a, b)
  np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-3, atol=1e-3)
  c = min(B, chunk)
  if chunk == 1:  # rows 1, 2, 3 at step 2, row 4 at step 4: one call of L rows each, against L calls of 1 row each
    assert fits[True] == [L] * 4 and fits[False] == [1] * (4 * L - 2), fits  # layers 0 and 1 refit three rows
  else:  # per layer: one chunk at step 2 (3 rows, padded to c), a single row at step 4; across layers, chunks of
    # 8 // L = 2 rows (a fit of at most refit_chunk (layer, row) pairs): rows 1 and 2, then 3 alone, then 4 alone
    assert sorted(fits[True]) == sorted([L * 2, L, L]) and sorted(fits[False]) == sorted([c] * L + [1] * L), fits


def test_later_tokens_of_a_multi_token_extend_refit_in_their_layer(monkeypatch):
  """`before_step` refits only the flushes of the step's first token; an `extend` of T = 3 tokens then refits the
  rows whose windows fill during the call inside each layer, as before (`refits_done` is cleared after the first
  token). Row 0 flushes at token 0 (hoisted: one fit of L rows), rows 1 and 2 at token 1 (a chunk per layer), row 4
  at token 2 (one row per layer). Caches and outputs equal the per-layer refits', and the caches come back unmarked
  (the pytree structure the step started with)."""
  calls = counting_fits(monkeypatch)
  lengths = jnp.array([R - 1, R - 2, R - 2, 60, R - 3])
  kvs = [_layer_kv(i, 64) for i in range(L)]
  q = jax.random.normal(jax.random.PRNGKey(5), (B, 4, K * G, H))
  runs, fits = {}, {}
  for across in (True, False):
    mode = OSKVPMode(window=R, refit_across_layers=across)
    layers = tuple(jax.jit(lambda k, v: mode.from_prefill(k, v, lengths, S, layer=0))(k[:, :60], v[:, :60])
                   for k, v in kvs)
    treedef = jax.tree_util.tree_structure(layers)

    @functools.partial(jax.jit, static_argnames=("start", "t"))
    def step(layers, start, t):
      outs = []
      for layer, (k, v) in zip(before_step(layers), kvs):
        idx = (lengths[:, None] + start + jnp.arange(t)[None, :])[:, :, None, None]
        outs.append(layer.extend(q[:, start:start + t], jnp.take_along_axis(k, idx, 1),
                                 jnp.take_along_axis(v, idx, 1), lengths + start))
      return [o for o, _ in outs], tuple(c for _, c in outs)

    o1, layers = step(layers, 0, t=1)
    calls.clear()
    o3, layers = step(layers, 1, t=3)
    jax.effects_barrier()
    fits[across] = list(calls)
    assert jax.tree_util.tree_structure(layers) == treedef
    np.testing.assert_array_equal(layers[0].refit, [False, False, False, False, False])
    runs[across] = (layers, jnp.stack([jnp.concatenate(o, axis=1) for o in zip(o1, o3)]))  # [L, B, 4, N, H]
  for a, b in zip(runs[True][0], runs[False][0]):
    assert_same_refits(a, b)
  np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-3, atol=1e-3)
  assert sorted(fits[True]) == sorted([L] + [B, 1] * L) and sorted(fits[False]) == sorted([1, B, 1] * L), fits


def test_an_empty_extend_appends_nothing_and_clears_the_mark():
  """T = 0 (before: jnp.stack of nothing raised inside the cache): [B, 0, N, H] in q's dtype, the cache's arrays as
  they were, and the step's `before_step` mark gone (a marked layer's next flush would skip its refit)."""
  k, v = _layer_kv(0, 30)
  layer = OSKVPMode(window=R).from_prefill(k[:, :5], v[:, :5], jnp.full((B,), 5, jnp.int32), S, layer=0)
  marked = layer.replace(refits_done=True)
  q = jnp.zeros((B, 0, K * G, H), jnp.bfloat16)
  o, out = marked.extend(q, k[:, :0], v[:, :0], jnp.full((B,), 5, jnp.int32))
  assert o.shape == (B, 0, K * G, H) and o.dtype == jnp.bfloat16 and not out.refits_done
  for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(layer)):
    np.testing.assert_array_equal(a, b)


def test_layers_without_refit_flags_pass_through():
  """Dense layers, an OS-KVP cache built without refits, and a mode with refit_across_layers=False are returned as
  they are (the same objects), so their steps are unchanged."""
  k, v = _layer_kv(0, 30)
  lengths = jnp.full((B,), 30, jnp.int32)
  dense = get_kv_cache_mode("bf16").from_prefill(k, v, lengths, S, layer=0)
  no_refit = OSKVPMode(window=R, refit_at_first_flush=False).from_prefill(k, v, lengths, S, layer=0)
  off = OSKVPMode(window=R, refit_across_layers=False).from_prefill(k, v, lengths, S, layer=0)
  layers = (dense, no_refit, off)
  assert all(a is b for a, b in zip(refit_before_step(layers), layers))
  assert all(a is b for a, b in zip(before_step(layers), layers))


def test_the_model_step_refits_across_layers(tiny_config, monkeypatch):
  """A 3-layer tiny model with prompts inside a 16-token window, decoded 20 steps with greedy tokens: refitting
  before the step gives the logits of the per-layer refits (1e-3 of the largest logit) and refits all layers in
  one fit call at the first flush, where the per-layer refits take one call per layer."""
  calls = counting_fits(monkeypatch)
  config = tiny_config.replace(n_layers=3)
  model = decode.init_model(config, seed=1)
  names = {True: "oskvp_test_refit_across_layers", False: "oskvp_test_refit_per_layer"}
  for across, name in names.items():
    register_kv_cache_mode(name, dataclasses.replace(get_kv_cache_mode("oskvp"), window=16,
                                                     refit_across_layers=across))
  try:
    tokens = np.array(jax.random.randint(jax.random.PRNGKey(4), (3, 12), 1, config.vocab_size))
    lengths = np.array([12, 9, 5])
    logits, fits = {}, {}
    for across, name in names.items():
      out, cache = decode.prefill(model, tokens, lengths, kv_cache=name, cache_len=64, last_only=True)
      calls.clear()
      seq = []
      for _ in range(20):
        out, cache = decode.decode_step(model, cache, jnp.argmax(out, -1).astype(jnp.int32))
        seq.append(out)
      jax.effects_barrier()
      fits[across] = list(calls)
      assert not bool(jnp.any(jnp.stack([layer.refit for layer in cache.layers])))
      logits[across] = np.stack(seq)
    scale = np.abs(logits[False]).max()
    np.testing.assert_allclose(logits[True], logits[False], atol=1e-3 * scale, rtol=0)
    # Rows flush at steps 4, 7 and 11, one at a time: three calls of 3 layers' row, against 3 calls per flush.
    assert fits[True] == [3, 3, 3] and fits[False] == [1] * 9, fits
  finally:
    for name in names.values():
      KV_CACHE_MODES.pop(name)
