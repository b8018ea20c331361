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
P = 60  # prefill tokens (the prompts' lengths are at most P)


def _layer_kv(layer: int, t: int) -> tuple[jax.Array, jax.Array]:
  return layer_kv(layer, (B, t, K, H))


@functools.partial(jax.jit, static_argnums=0)
def _prefill(mode: OSKVPMode, k: jax.Array, v: jax.Array, lengths: jax.Array):
  """`mode.from_prefill` of k, v [B, P, K, H] (one program for the modes here that differ only in how they refit,
  traced per mode and read back from the compilation cache)."""
  return mode.from_prefill(k, v, lengths, S, layer=0)


@pytest.mark.parametrize("chunk", [1, 8])
def test_refits_before_the_step_are_the_per_layer_refits(chunk, monkeypatch):
  """L = 3 layers, a long prompt (row 0) and four inside the window: three rows flush at step 2 and one at step 4.
  Layer 1 does not flag row 2 and layer 0 not row 3 (their flags cleared after prefill), so those layers keep those
  rows' prefill fits while the other layers refit them. Refitting before the step (`refit_before_step`, then each
  layer's `extend`, in one program) gives the caches and outputs of the per-layer refits (`before_step` passes those
  layers through; each layer's `extend` is then its own program, one for all layers), with one fit call per chunk
  for all layers (chunk 8: chunks of 8 // L = 2 rows; chunk 1: one call of L rows per flushing row) instead of one
  per layer and chunk, and the layers' own flushes trace no refit then."""
  calls = counting_fits(monkeypatch)
  lengths = jnp.array([P, R - 1, R - 1, R - 1, R - 3])
  steps = 5
  kvs = [_layer_kv(i, P + steps) for i in range(L)]
  q = jax.random.normal(jax.random.PRNGKey(3), (B, steps, K * G, H))

  def layer_step(layer, k, v, i):  # one layer's `extend` of token i
    idx = (lengths + i)[:, None, None, None]
    return layer.extend(q[:, i][:, None], jnp.take_along_axis(k, idx, 1), jnp.take_along_axis(v, idx, 1),
                        lengths + i)

  @jax.jit
  def step(layers, i):  # the model step's order: `before_step`, then each layer's `extend`
    outs = [layer_step(layer, k, v, i) for layer, (k, v) in zip(before_step(tuple(layers)), kvs)]
    return [o for o, _ in outs], [c for _, c in outs]

  one_layer = jax.jit(layer_step)

  def per_layer_step(layers, i):  # the same calls, each layer's `extend` jitted alone (the per-layer refits)
    outs = [one_layer(layer, k, v, i) for layer, (k, v) in zip(before_step(tuple(layers)), kvs)]
    return [o for o, _ in outs], [c for _, c in outs]

  runs, fits = {}, {}
  for across in (True, False):
    mode = OSKVPMode(window=R, refit_chunk=chunk, refit_across_layers=across)
    layers = [_prefill(mode, k[:, :P], v[:, :P], lengths) for k, v in kvs]
    layers[1] = layers[1].replace(refit=layers[1].refit.at[2].set(False))
    layers[0] = layers[0].replace(refit=layers[0].refit.at[3].set(False))  # row 3: flagged in later layers only
    u_kept, u_prefill = np.asarray(layers[1].u_k[2]), np.asarray(layers[0].u_k[2])
    u3 = [np.asarray(layer.u_k[3]) for layer in layers]
    # The layers' own flushes do not trace a refit when the refits come before the step (`refits_done`): eigh
    # appears in the chunk and single-row fits once for all layers, against once in each layer's `extend`.
    if across:
      eighs = str(jax.make_jaxpr(step)(layers, 0)).count("name=eigh")  # calls of the jitted eigh
    else:
      assert all(a is b for a, b in zip(before_step(tuple(layers)), layers))
      eighs = str(jax.make_jaxpr(one_layer)(layers[0], *kvs[0], 0)).count("name=eigh")
    assert eighs == (1 if chunk == 1 else 2), eighs
    run = step if across else per_layer_step
    calls.clear()
    outs = []
    for i in range(steps):
      o, layers = run(layers, i)
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
  token). L = 2 layers; one decoded token (no window full yet) brings row 0's window to R, then the step of T = 3:
  row 0 flushes at its token 0 (hoisted: one fit of L rows), rows 1 and 2 at token 1 (a chunk per layer), row 4 at
  token 2 (one row per layer). Caches and outputs equal the per-layer refits', and the caches come back unmarked
  (the pytree structure the step started with). `before_step` and the layers' `extend` are jitted apart (the mark
  is static: it passes between programs as within one), the `extend` one program for both layers."""
  calls = counting_fits(monkeypatch)
  n_layers = 2  # the hoisted fit is one of L rows against L fits of one row at any L > 1
  lengths = jnp.array([R - 1, R - 2, R - 2, P, R - 3])
  kvs = [_layer_kv(i, 64) for i in range(n_layers)]
  q = jax.random.normal(jax.random.PRNGKey(5), (B, 4, K * G, H))

  def layer_step(layer, k, v, start, t):  # one layer's `extend` of tokens start .. start + t - 1 of each row
    idx = (lengths[:, None] + start + jnp.arange(t)[None, :])[:, :, None, None]
    return layer.extend(q[:, start:start + t], jnp.take_along_axis(k, idx, 1), jnp.take_along_axis(v, idx, 1),
                        lengths + start)

  # The first token flushes no row: each layer's `extend` of it, marked as `before_step` marks it (so no refit is
  # traced: none would run), one program for all layers and both runs.
  first = jax.jit(lambda layer, k, v: layer_step(layer.replace(refits_done=True), k, v, 0, 1))

  hoisted = jax.jit(lambda layers: before_step(layers))  # a fresh trace: its fit counter writes to this `calls`
  extend = jax.jit(lambda layer, k, v: layer_step(layer, k, v, 1, 3))

  def step(layers):  # tokens 1, 2 and 3: `before_step`, then each layer's `extend` of T = 3 (one program for all)
    outs = [extend(layer, k, v) for layer, (k, v) in zip(hoisted(layers), kvs)]
    return [o for o, _ in outs], tuple(c for _, c in outs)

  runs, fits = {}, {}
  for across in (True, False):
    mode = OSKVPMode(window=R, refit_across_layers=across)
    layers = tuple(_prefill(mode, k[:, :P], v[:, :P], lengths) for k, v in kvs)
    treedef = jax.tree_util.tree_structure(layers)
    o1, layers = zip(*(first(layer, k, v) for layer, (k, v) in zip(layers, kvs)))
    calls.clear()
    o3, layers = step(tuple(layers))
    jax.effects_barrier()
    fits[across] = list(calls)
    assert jax.tree_util.tree_structure(layers) == treedef
    np.testing.assert_array_equal(layers[0].refit, [False, False, False, False, False])
    runs[across] = (layers, jnp.stack([jnp.concatenate(o, axis=1) for o in zip(o1, o3)]))  # [L, B, 4, N, H]
  for a, b in zip(runs[True][0], runs[False][0]):
    assert_same_refits(a, b)
  np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-3, atol=1e-3)
  assert (sorted(fits[True]) == sorted([n_layers] + [B, 1] * n_layers)
          and sorted(fits[False]) == sorted([1, B, 1] * n_layers)), fits


def test_an_empty_extend_appends_nothing_and_clears_the_mark():
  """T = 0 (before: jnp.stack of nothing raised inside the cache): [B, 0, N, H] in q's dtype, the cache's arrays as
  they were, and the step's `before_step` mark gone (a marked layer's next flush would skip its refit)."""
  k, v = _layer_kv(0, P)
  layer = _prefill(OSKVPMode(window=R), k, v, jnp.full((B,), 5, jnp.int32))  # 5-token prompts
  marked = layer.replace(refits_done=True)
  q = jnp.zeros((B, 0, K * G, H), jnp.bfloat16)
  o, out = marked.extend(q, k[:, :0], v[:, :0], jnp.full((B,), 5, jnp.int32))
  assert o.shape == (B, 0, K * G, H) and o.dtype == jnp.bfloat16 and not out.refits_done
  for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(layer)):
    np.testing.assert_array_equal(a, b)


def test_layers_without_refit_flags_pass_through():
  """Dense layers, an OS-KVP cache built without refits, and a mode with refit_across_layers=False are returned as
  they are (the same objects), so their steps are unchanged."""
  k, v = _layer_kv(0, P)
  lengths = jnp.full((B,), 30, jnp.int32)
  dense = get_kv_cache_mode("bf16").from_prefill(k, v, lengths, S, layer=0)
  no_refit = _prefill(OSKVPMode(window=R, refit_at_first_flush=False), k, v, lengths)
  off = _prefill(OSKVPMode(window=R, refit_across_layers=False), k, v, lengths)
  layers = (dense, no_refit, off)
  assert all(a is b for a, b in zip(refit_before_step(layers), layers))
  assert all(a is b for a, b in zip(before_step(layers), layers))


def test_the_model_step_refits_across_layers(tiny_config, monkeypatch):
  """The tiny model (L = 2 layers) with prompts inside a 16-token window, decoded 20 steps with greedy tokens:
  refitting before the step gives the logits of the per-layer refits (1e-3 of the largest logit) and refits all
  layers in one fit call at the first flush, where the per-layer refits take one call per layer."""
  calls = counting_fits(monkeypatch)
  config = tiny_config
  assert config.n_layers == 2
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
    # Rows flush at steps 4, 7 and 11, one at a time: three calls of 2 layers' row, against 2 calls per flush.
    assert fits[True] == [2, 2, 2] and fits[False] == [1] * 6, fits
  finally:
    for name in names.values():
      KV_CACHE_MODES.pop(name)


def test_weakly_typed_prompt_lengths_give_a_cache_the_step_keeps_its_types():
  """`jnp.full((B,), n)` is weakly typed. The refit mask built from such prompt lengths was too, and `before_step`
  returns it strongly typed, so a jitted decode step saw new input types at its second call and compiled again. The
  prefilled cache now has no weakly typed leaf, and a jitted step traces once over its own output."""
  k, v = _layer_kv(0, P)
  lengths = jnp.full((B,), 3)
  assert jax.typeof(lengths).weak_type
  layers = (_prefill(OSKVPMode(window=R), k, v, lengths),)
  weak = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(layers) if jax.typeof(x).weak_type]
  assert not weak, weak
  q = jax.random.normal(jax.random.PRNGKey(9), (B, 1, K * G, H))
  traces = []

  @jax.jit
  def step(layers, t):  # as the model's decode step runs a layer: `before_step`, then its `extend`
    traces.append(1)
    (layer,) = before_step(layers)
    at = lambda x: jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)  # noqa: E731  token t, [B, 1, K, H]
    return (layer.extend(q, at(k), at(v), None)[1],)

  step(step(layers, 3), 4)
  assert len(traces) == 1
