"""The OS-KVP layer cache: prefill split, flushes, the two attention forms, and model-level decode."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import decode
from moe_jax.kv_cache import get_kv_cache_mode, masked_gqa_attention, register_kv_cache_mode
from moe_jax.kv_quant import OSKVPMode, oskvp
from moe_jax.kv_quant import oskvp_attention as attn
from moe_jax.layers import rope

B, K, G, H, R = 2, 2, 2, 32, 8


@functools.partial(jax.jit, static_argnums=1)
def kv(key, t):
  k1, k2 = jax.random.split(key)
  std = jnp.ones(H).at[jnp.array([3, 17])].set(6.0)
  return (jax.random.normal(k1, (B, t, K, H)) * std + std * 0.3, jax.random.normal(k2, (B, t, K, H)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _outlier_kv(t, h):
  """Keys with an outlier channel 9 and values, [B, t, K, h] (seeds 5 and 6)."""
  k = jax.random.normal(jax.random.PRNGKey(5), (B, t, K, h)) * jnp.ones(h).at[9].set(5.0)
  return k, jax.random.normal(jax.random.PRNGKey(6), (B, t, K, h))


@jax.jit
def _requantize(x, u, scale, cb, b, h):
  """oskvp.quantize then dequantize of x[b, :, h] with the cache's (b, h) parameters (b, h traced: one program)."""
  params = jax.tree_util.tree_map(lambda a: a[b, h], oskvp.OSKVPParams(u, scale, cb))
  return oskvp.dequantize(oskvp.quantize(x[b, :, h], params), params)


# Programs shared across tests. Compiling them is most of this file's time, so tests that need the same mode at the
# same shapes call these one jitted functions (one trace and one compile per process) rather than a fresh
# `jax.jit(lambda ...)` each.
@functools.partial(jax.jit, static_argnames=("mode", "cache_len"))
def _prefill(k, v, lengths, *, mode, cache_len):
  """`mode.from_prefill` at layer 0 with the lengths traced: one program per (mode, shapes, cache_len). Tokens past
  each row's length are masked, so tests zero-pad their prompts (`_pad`) to a shared T."""
  return mode.from_prefill(k, v, lengths, cache_len, layer=0)


@jax.jit
def _extend(cache, q, k, v):
  """`cache.extend` (the cache keeps its own positions; the starts are unused): one program per cache structure."""
  return cache.extend(q, k, v, jnp.zeros(q.shape[0], jnp.int32))


def _pad(x, t):
  """x [B, T0, ...] zero-padded to [B, t, ...] along the tokens."""
  return jnp.pad(x, ((0, 0), (0, t - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


# The head_dim-64 tests (`test_layout_matches_the_pallas_kernel_reference`, `test_an_all_zero_head_...`,
# `test_biased_keys_...`) share one geometry: prompts padded to T64 tokens, caches of S64 positions, window R.
T64, S64 = 140, 256

# Tests about something else in which no row is refitted (prompts at least the window long, or no flush of a shorter
# one) leave the refit at the first flush off (`OSKVPMode.refit_at_first_flush`): the outputs are the same, but the
# flag compiles a fit (two: a chunk of rows and a single row) into every step, most of such a step's compile. The
# refit machinery idle beside flushing rows is asserted with it on by test_extend_flushes_and_attends_over_what_it_
# stores[2-3] (flushed blocks coded with the prefill's U and codebooks), test_a_prompt_inside_the_window_is_refitted_
# at_its_first_flush (the 50-token row keeps its prefill fit through its flush, uniform or not, every step's output
# consistent) and test_model_decode_tracks_bf16_cache and test_prefill_nan_in_the_compressed_store_comes_back_nan
# (the registered modes, model level and NaN handling).
NO_REFIT = {"refit_at_first_flush": False}


def test_prefill_split_and_stored_tokens():
  k, v = kv(jax.random.PRNGKey(0), 40)
  lengths = jnp.array([40, 29])
  # S = 64: the prefill program of test_extend_flushes_and_attends_over_what_it_stores[2-None] (`NO_REFIT`).
  cache = _prefill(k, v, lengths, mode=OSKVPMode(window=R, **NO_REFIT), cache_len=64)
  np.testing.assert_array_equal(cache.n_comp, [32, 24])
  np.testing.assert_array_equal(cache.n_res, [8, 5])
  assert cache.codes_k.shape == (B, K, 64, H // 4) and cache.outl_k.shape == (B, K, 64, 8)
  assert cache.res_k.shape == (B, K, R, H) and cache.res_k.dtype == jnp.bfloat16 and cache.u_k.shape == (B, K, H, H)
  assert cache.hi_k is None and cache.max_len == 64
  k_hat, v_hat = cache.dequantized()
  for b, n in enumerate([40, 29]):
    nc = int(cache.n_comp[b])
    # The window holds the last tokens up to bf16 rounding (rotated, stored, rotated back).
    np.testing.assert_allclose(k_hat[b, nc:n], k[b, nc:n], atol=0.03 * float(jnp.abs(k).max()))
    np.testing.assert_allclose(v_hat[b, n:], 0.0)
    for h in range(K):  # the first 24 compressed tokens of each row (one shape, one compile)
      ref = _requantize(k[:, :24], cache.u_k, cache.scale_k, cache.cb_k, b, h)
      np.testing.assert_allclose(k_hat[b, :24, h], ref, atol=1e-4)
    assert float(jnp.linalg.norm(k_hat[b, :nc] - k[b, :nc]) / jnp.linalg.norm(k[b, :nc])) < 0.3
  # A fitted basis is orthogonal per (sequence, head).
  np.testing.assert_allclose(jnp.einsum("BKHI,BKHJ->BKIJ", cache.u_k, cache.u_k),
                             jnp.broadcast_to(jnp.eye(H), (B, K, H, H)), atol=3e-5)


@functools.partial(jax.jit, static_argnums=0)
def _lut_inputs(bits):
  """Random codes, outliers, scales, codebooks and rotated queries for `bits` (one program per bit width)."""
  s, o, n_levels = 24, 8, 2**bits
  ks = jax.random.split(jax.random.PRNGKey(bits), 6)
  idx = jax.random.randint(ks[0], (B, K, s, H), 0, n_levels).astype(jnp.uint8)
  codes = oskvp.pack2(idx)
  hi = oskvp.pack1(idx >> 2) if bits == 3 else None
  outl = (jax.random.normal(ks[1], (B, K, s, o)) * 100).astype(oskvp.FP8)
  scale = jax.random.uniform(ks[2], (B, K, o), minval=0.01, maxval=0.1)
  cb = jnp.sort(jax.random.normal(ks[3], (B, K, H, n_levels)), axis=-1).at[:, :, :o].set(0.0)
  qr = jax.random.normal(ks[4], (B, K, G, H))
  return idx, codes, hi, outl, scale, cb, qr


@functools.partial(jax.jit, static_argnums=5)
def _explicit_scores(qr, idx, outl, scale, cb, o):
  """Scores against an explicit per-element dequantization."""
  xr = jnp.take_along_axis(cb, jnp.swapaxes(idx.astype(jnp.int32), 2, 3), axis=-1)  # [B, K, H, S]
  xr = jnp.swapaxes(xr, 2, 3).at[..., :o].add(outl.astype(jnp.float32) * scale[:, :, None])
  return jnp.einsum("BKGH,BKSH->BKGS", qr, xr)


@pytest.mark.parametrize("bits", [2, 3])
def test_lut_scores_equal_dequantized_scores(bits):
  o = 8
  idx, codes, hi, outl, scale, cb, qr = _lut_inputs(bits)
  lut = attn.compressed_scores(qr, codes, outl, scale, cb, hi, form="lut")
  deq = attn.compressed_scores(qr, codes, outl, scale, cb, hi, form="dequant")
  np.testing.assert_allclose(lut, deq, rtol=1e-5, atol=1e-4)
  # And against an explicit per-element dequantization.
  np.testing.assert_allclose(deq, _explicit_scores(qr, idx, outl, scale, cb, o), rtol=1e-5, atol=1e-4)
  p = jax.nn.softmax(lut, axis=-1)
  np.testing.assert_allclose(attn.compressed_values(p, codes, outl, scale, cb, hi, form="lut"),
                             attn.compressed_values(p, codes, outl, scale, cb, hi, form="dequant"), atol=1e-5)


@functools.partial(jax.jit, static_argnames=("form",))
def _attend(cache, q, form):
  return attn.oskvp_decode_attention_xla(
      q, cache.codes_k, cache.outl_k, cache.scale_k, cache.cb_k, cache.codes_v, cache.outl_v, cache.scale_v,
      cache.cb_v, cache.u_k, cache.u_v, cache.res_k, cache.res_v, cache.n_comp, cache.n_res, hi_k=cache.hi_k,
      hi_v=cache.hi_v, form=form)


@jax.jit
def _visible_attention(q, k_hat, v_hat, total):
  """Dense attention over the first `total` tokens of each row."""
  visible = (jnp.arange(k_hat.shape[1])[None, :] < total[:, None])[:, None, :]
  return masked_gqa_attention(q, k_hat, v_hat, visible)


@pytest.mark.parametrize("bits,key_bits", [(2, None), (3, None), (2, 3)])
def test_extend_flushes_and_attends_over_what_it_stores(bits, key_bits):
  """Decode crossing flushes: every step's output equals dense attention over the cache's own dequantized tokens,
  both attention forms agree, and flushed blocks equal the quantizer applied to the (bf16) window. (2, 3): 3-bit
  keys with 2-bit values ("oskvp_k3v2"), with the refit at the first flush on as registered (idle: prompts of 40 and
  29 tokens; its programs are those of test_3_bit_keys_with_2_bit_values_are_refitted_at_the_first_flush_...). (3,
  None) keeps it on too, idle: the one test that traces a refit of 3-bit values (8-level codebooks and `hi_v`). (2,
  None) has it off (`NO_REFIT`), and runs the 9 tokens again as one `extend` (T = 9): the same outputs and cache."""
  k, v = kv(jax.random.PRNGKey(1), 40)
  lengths = jnp.array([40, 29])
  mode = OSKVPMode(window=R, bits=bits, key_bits=key_bits, refit_at_first_flush=key_bits is not None or bits == 3)
  cache = _prefill(k, v, lengths, mode=mode, cache_len=64)
  assert cache.cb_k.shape[-1] == 2**mode.k_bits and cache.cb_v.shape[-1] == 2**bits
  assert (cache.hi_k is not None) == (mode.k_bits == 3) and (cache.hi_v is not None) == (bits == 3)
  new_k, new_v = kv(jax.random.PRNGKey(2), 9)
  qs = jax.random.normal(jax.random.PRNGKey(3), (B, 9, K * G, H))
  prefilled, outs = cache, []
  for t in range(9):
    o, cache = _extend(cache, qs[:, t:t + 1], new_k[:, t:t + 1], new_v[:, t:t + 1])
    outs.append(o)
    k_hat, v_hat = cache.dequantized()
    total = cache.n_comp + cache.n_res
    np.testing.assert_array_equal(total, lengths + t + 1)
    ref = _visible_attention(qs[:, t:t + 1], k_hat, v_hat, total)
    np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_attend(cache, qs[:, t], "dequant"), o[:, 0], rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(cache.n_comp, [48, 32])  # two flushes for row 0, one for row 1
  np.testing.assert_array_equal(cache.n_res, [1, 6])
  # Row 1's tokens 24..31 (5 from the prefill, 3 decoded) were flushed at step 4 with the prefill's U and codebooks.
  seq_k = jnp.concatenate([k[1, :29], new_k[1]], axis=0)  # [38, K, H]
  for h in range(K):
    params = oskvp.OSKVPParams(cache.u_k[1, h], cache.scale_k[1, h], cache.cb_k[1, h])
    rot = (seq_k[24:32, h] @ params.u).astype(jnp.bfloat16).astype(jnp.float32)
    ref = oskvp.dequantize_rotated(oskvp.quantize_rotated(rot, params.codebook, params.scale), params.codebook,
                                   params.scale) @ params.u.T
    np.testing.assert_allclose(k_hat[1, 24:32, h], ref, atol=1e-4)
  if (bits, key_bits) == (2, None):  # the same 9 tokens as one extend (a scan after the first): the same steps
    o_all, at_once = _extend(prefilled, qs, new_k, new_v)
    np.testing.assert_allclose(o_all, jnp.concatenate(outs, axis=1), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(at_once, cache, rtol=1e-5, atol=1e-5)
    # The program does not grow with T: 3 and 9 tokens trace to the same top-level equations.
    n_eqns = lambda t: len(jax.make_jaxpr(_extend.__wrapped__)(prefilled, qs[:, :t], new_k[:, :t],  # noqa: E731
                                                               new_v[:, :t]).eqns)
    assert n_eqns(3) == n_eqns(9)


def test_3_bit_keys_with_2_bit_values_are_refitted_at_the_first_flush_with_their_own_bits():
  """Prompts shorter than the window: the refit at the first flush keeps 8-level key and 4-level value codebooks, and
  the step after it attends over what the cache stores. (The prefill and step programs are those of
  test_extend_flushes_and_attends_over_what_it_stores[2-3], the same mode: prompts zero-padded to its 40 tokens.)"""
  k, v = kv(jax.random.PRNGKey(7), R + 5)
  lengths = jnp.array([3, 5])
  mode = dataclasses.replace(get_kv_cache_mode("oskvp_k3v2"), window=R)  # the registered mode, a window of R
  cache = _prefill(_pad(k[:, :5], 40), _pad(v[:, :5], 40), lengths, mode=mode, cache_len=64)
  q = jax.random.normal(jax.random.PRNGKey(8), (B, 1, K * G, H))
  for t in range(R):
    o, cache = _extend(cache, q, k[:, 5 + t:6 + t], v[:, 5 + t:6 + t])
  assert not bool(jnp.any(cache.refit)) and int(cache.n_comp[0]) == R  # row 0 flushed (and refitted)
  assert cache.cb_k.shape[-1] == 8 and cache.cb_v.shape[-1] == 4 and cache.hi_k is not None and cache.hi_v is None
  assert not np.allclose(np.asarray(cache.u_k[0, 0]), np.eye(H), atol=1e-3)  # fitted, not the placeholder
  k_hat, v_hat = cache.dequantized()
  ref = _visible_attention(q, k_hat, v_hat, cache.n_comp + cache.n_res)
  np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-4)


def test_implementation_switch():
  with pytest.raises(ValueError, match="key_bits=4 must be None, 2 or 3"):
    OSKVPMode(key_bits=4)
  with pytest.raises(ValueError, match="2-bit keys"):
    OSKVPMode(key_bits=3, uniform=True)
  with pytest.raises(ValueError, match="implementation"):
    OSKVPMode(implementation="cuda")
  with pytest.raises(ValueError, match="bits"):
    OSKVPMode(bits=4)
  with pytest.raises(ValueError, match="symmetric"):
    OSKVPMode(bits=3, symmetric=True)
  with pytest.raises(ValueError, match="uniform"):
    OSKVPMode(bits=3, uniform=True)
  with pytest.raises(ValueError, match="uniform"):
    OSKVPMode(uniform=True, symmetric=True)
  with pytest.raises(ValueError, match=r"outlier_fraction=1.5 must be in \[0, 1\)"):
    OSKVPMode(outlier_fraction=1.5)  # before: only at the first prefill
  with pytest.raises(ValueError, match=r"n_iters=-1 must be an int >= 0"):
    OSKVPMode(n_iters=-1)  # before: accepted, ran as 0 iterations


def test_symmetric_mode_reaches_the_bitplane_kernel():
  """OSKVPMode(symmetric=True) fits symmetric codebooks, marks the cache, and the Pallas bit-plane kernel (interpret
  mode, two plane types) agrees with the XLA path on that cache to the kernel's 1.5e-2 relative tolerance."""
  kernel = pytest.importorskip("pallas_kernels.oskvp_decode_attention")
  h = 128
  k, v = _outlier_kv(300, h)
  c = jax.jit(lambda k, v: OSKVPMode(window=R, symmetric=True).from_prefill(k, v, jnp.array([300, 150]), 320,
                                                                            layer=0))(k, v)
  assert c.symmetric and oskvp.symmetric_codebooks(c.cb_k) and oskvp.symmetric_codebooks(c.cb_v)
  q = jax.random.normal(jax.random.PRNGKey(7), (B, K * G, h))
  args = (q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v, c.cb_v, c.u_k, c.u_v, c.res_k,
          c.res_v, c.n_comp, c.n_res)
  config = dataclasses.replace(kernel.BITPLANE, block_s=64)
  out = kernel.oskvp_decode_attention(*args, interpret=True, config=config, symmetric_codebooks=True)
  ref = attn.oskvp_decode_attention(*args, implementation="xla")
  assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1.5e-2


def test_uniform_mode_marks_a_symmetric_cache():
  """OSKVPMode(uniform=True): equally spaced codebooks on both sides, and the cache is marked symmetric so that the
  Triton kernel takes its two-plane-type path. (Prompts of 140 and 130 tokens, both fitted, in a cache of S64
  positions, `NO_REFIT`: the prefill program of test_biased_keys_and_values_decode_as_well_as_unbiased_ones[pallas-
  True-128]; the mode's implementation does not enter it, so it is read back from the compilation cache.)"""
  h = 128
  k, v = _outlier_kv(300, h)
  c = _prefill(k[:, :T64], v[:, :T64], jnp.array([140, 130]), mode=OSKVPMode(window=R, uniform=True, **NO_REFIT),
               cache_len=S64)
  assert c.symmetric
  o = oskvp.n_outliers(h, 0.08)
  for cb in (c.cb_k, c.cb_v):
    steps = np.diff(np.asarray(cb)[..., o:, :], axis=-1)
    np.testing.assert_allclose(steps, np.broadcast_to(steps[..., :1], steps.shape), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["oskvp", "oskvp_uniform"])
def test_a_decode_step_on_an_empty_batch(tiny_model, mode):
  """B = 0: the prefill builds empty caches and a step gives [0, V] logits (before: the refit's one-row fit gathered
  a row of an empty batch and failed inside XLA, in a batch-0 gather)."""
  _, cache = decode.prefill(tiny_model, np.zeros((0, 4), np.int32), np.zeros((0,), np.int32), kv_cache=mode,
                            cache_len=16)
  logits, cache = decode.decode_step(tiny_model, cache, np.zeros((0,), np.int32))
  assert logits.shape == (0, tiny_model.config.vocab_size) and cache.lengths.shape == (0,)


def test_model_decode_tracks_bf16_cache(tiny_model):
  """Tiny random model, prompts of 40 and 29 tokens (one above and one below the H=32 samples the eigenbasis needs,
  so both the fitted and the fallback path run), window R=8, 10 teacher-forced decode steps crossing flushes.
  Tolerances (measured 0.11 relative logit error, KL 0.01): relative logit error < 0.25, mean KL < 0.03 nats; the
  cached keys are within 30% relative error of the bf16 cache's."""
  register_kv_cache_mode("oskvp_test_r8", OSKVPMode(window=R))
  tokens = jax.random.randint(jax.random.PRNGKey(4), (B, 52), 0, 256)
  lengths = jnp.array([40, 29])

  def run(mode):
    _, cache = decode.prefill(tiny_model, tokens[:, :40], lengths, kv_cache=mode, cache_len=56)
    out = []
    for i in range(10):
      logits, cache = decode.decode_step(tiny_model, cache, tokens[jnp.arange(B), lengths + i])
      out.append(logits)
    return jnp.stack(out, 1), cache

  ref, ref_cache = run("bf16")
  logits, cache = run("oskvp_test_r8")
  assert np.isfinite(np.asarray(logits)).all()
  np.testing.assert_array_equal(cache.layers[0].n_comp, [48, 32])
  np.testing.assert_array_equal(cache.lengths, [50, 39])
  assert cache.max_len == 56
  rel = float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref))
  lp, rp = jax.nn.log_softmax(logits), jax.nn.log_softmax(ref)
  kl = float(jnp.mean(jnp.sum(jnp.exp(rp) * (rp - lp), -1)))
  assert rel < 0.25 and kl < 0.03, (rel, kl)
  for layer, ref_layer in zip(cache.layers, ref_cache.layers):
    k_hat = layer.dequantized()[0][:, :50]
    k_ref = ref_layer.k[:, :50].astype(jnp.float32)
    assert float(jnp.linalg.norm(k_hat - k_ref) / jnp.linalg.norm(k_ref)) < 0.3


def test_layout_matches_the_pallas_kernel_reference():
  """The cache built here, read by the kernel module's plain-jnp reference, gives the same attention output: the two
  sides agree on the storage layout (planar codes, rotated window, outlier scales). The prefill program is that of
  the other head_dim-64 tests (`T64`, `S64`, `NO_REFIT`; the mode's implementation does not enter it)."""
  kernel = pytest.importorskip("pallas_kernels.oskvp_decode_attention")
  h = 64
  k, v = _outlier_kv(40, h)
  c = _prefill(_pad(k, T64), _pad(v, T64), jnp.array([40, 21]),
               mode=OSKVPMode(window=R, implementation="xla", **NO_REFIT), cache_len=S64)
  q = jax.random.normal(jax.random.PRNGKey(7), (B, K * G, h))
  args = (q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v, c.cb_v, c.u_k, c.u_v, c.res_k,
          c.res_v, c.n_comp, c.n_res)
  np.testing.assert_allclose(attn.oskvp_decode_attention(*args),
                             kernel.oskvp_decode_attention_reference(*args), atol=1e-5)


def test_long_prompts_fit_on_evenly_spaced_tokens():
  """max_fit_tokens: each sequence is subsampled over its own length; the fitted outlier direction is unchanged."""
  k = jax.random.normal(jax.random.PRNGKey(8), (B, 160, K, H)) * jnp.ones(H).at[3].set(8.0)
  lengths = jnp.array([160, 50])
  sub = jax.jit(lambda k: OSKVPMode(window=R, max_fit_tokens=64).fit(k, lengths))(k)
  full = jax.jit(lambda k: OSKVPMode(window=R).fit(k, lengths))(k)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(sub))
  np.testing.assert_allclose(jnp.abs(jnp.sum(sub.u[..., 0] * full.u[..., 0], axis=-1)), 1.0, atol=0.01)
  assert float(sub.u[..., 3, 0].min()) > 0.99  # channel 3 leads, sign fixed positive


@jax.jit
def _rope_keys():
  """Offset keys at positions 0-511 after RoPE (one program)."""
  pre = jax.random.normal(jax.random.PRNGKey(9), (1, 512, 1, H)) + jnp.zeros(H).at[jnp.array([8, 24])].set(
      jnp.array([10.0, 6.0]))
  return rope(pre, jnp.arange(512)[None], 1e4)


def test_rope_shift_augmentation_fits_later_positions():
  """A large, offset key pair that RoPE turns by ~2.6 rad over 256 positions: fitted on positions 0-255, the
  augmented fit quantizes positions 256-511 better than a fit on the prefill positions alone (measured 0.134 vs
  0.160 relative error)."""
  k = _rope_keys()
  errs = []
  for mode in (OSKVPMode(window=R), OSKVPMode(window=R, rope_theta=None)):
    fit = jax.jit(lambda x, mode=mode: mode.fit(x, jnp.array([256]), rope_span=512))
    p = jax.tree_util.tree_map(lambda a: a[0, 0], fit(k[:, :256]))
    x = k[0, 256:, 0]
    errs.append(float(jnp.linalg.norm(oskvp.dequantize(oskvp.quantize(x, p), p) - x) / jnp.linalg.norm(x)))
  assert errs[0] < 0.9 * errs[1], errs


@pytest.mark.parametrize("uniform, head_dim", [(False, 64), (True, 128)])
def test_pallas_implementation_runs_in_interpret_mode_off_the_gpu(uniform, head_dim):
  """OSKVPMode(implementation="pallas") failed on the CPU ("Only interpret mode is supported"); the per-token and
  KIVI caches already ran their kernels in interpret mode there. uniform=True at H=128 takes the Mosaic GPU core
  (`OSKVPLayerCache.runs_mosaic_core`), which the cache called with interpret=False and failed the same way.
  `NO_REFIT`: the one decode step flushes no row."""
  import configs  # pylint: disable=g-import-not-at-top
  from moe_jax.generate import pad_batch  # pylint: disable=g-import-not-at-top
  cfg = configs.get("tiny").replace(max_seq_len=64, head_dim=head_dim, n_layers=1)
  model = decode.init_model(cfg, seed=1)
  rng = np.random.default_rng(0)
  tokens, lengths = pad_batch([list(rng.integers(0, 256, 40)), list(rng.integers(0, 256, 20))])
  out = {}
  for impl in ("xla", "pallas"):
    name = f"oskvp_interp_{impl}_{'uniform' if uniform else 'free'}"
    register_kv_cache_mode(name, OSKVPMode(bits=2, window=32, implementation=impl, uniform=uniform, **NO_REFIT))
    _, cache = decode.prefill(model, tokens, lengths, kv_cache=name, cache_len=64 if uniform else 48)
    assert cache.layers[0].runs_mosaic_core(cfg.n_heads) == (uniform and impl == "pallas")
    out[impl] = np.asarray(decode.decode_step(model, cache, np.array([5, 6], np.int32))[0])
  scale = np.abs(out["xla"]).max()
  np.testing.assert_allclose(out["pallas"], out["xla"], atol=0.01 * scale)  # bf16 operands in the kernel


@pytest.mark.parametrize("implementation,uniform", [("xla", False), ("pallas", False), ("xla", True)])
def test_an_all_zero_head_at_prefill_decodes_later_tokens(implementation, uniform):
  """kv head 0 all zero in the prefill (keys and values: a zero-initialised or pruned projection), non-zero tokens
  decoded after it and flushed into the compressed store (lengths 37 and 29, R=8: both rows flush 3 decoded tokens at
  step 3). The cache stays finite, the prefill's zeros stay exact, the decoded values come back within the short-prompt
  fallback's 0.6 relative error (keys within 0.8, measured 0.73: their channel 9 runs 5x the borrowed magnitude, which
  a fit on zeros cannot know; values measured 0.40-0.48), and kv head 0's attention output is within 0.5 relative
  error of dense attention over the bf16 tokens (measured 0.34-0.36 in all three cases, 2026-12-07; 0.39-0.40 for
  the ordinary head 1). Before, the head's levels were ~1e-10 apart and its fp8 scales ~1e-33: the decoded tokens
  came back as zeros (error 1.0; attention error 0.98). Pallas runs in interpret mode here. The prompts are
  zero-padded to T64 tokens in a cache of S64 positions, `NO_REFIT`: the prefill and step programs of
  test_biased_keys_and_values_decode_as_well_as_unbiased_ones at the same mode (uniform=False)."""
  if implementation == "pallas":
    pytest.importorskip("pallas_kernels.oskvp_decode_attention")
  h, steps, s, ns = 64, 6, S64, [37, 29]
  k, v = _outlier_kv(37, h)
  k, v = k.at[:, :, 0].set(0.0), v.at[:, :, 0].set(0.0)
  new_k, new_v = _outlier_kv(steps, h)
  qs = jax.random.normal(jax.random.PRNGKey(3), (B, steps, K * G, h))
  mode = OSKVPMode(window=R, implementation=implementation, uniform=uniform, **NO_REFIT)
  cache = _prefill(_pad(k, T64), _pad(v, T64), jnp.array(ns), mode=mode, cache_len=s)
  for t in range(steps):
    o, cache = _extend(cache, qs[:, t:t + 1], new_k[:, t:t + 1], new_v[:, t:t + 1])
  assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree_util.tree_leaves(cache))
  np.testing.assert_array_equal(cache.n_comp, [40, 32])
  # The true sequences in bf16, zero-padded to s: [B, s, K, h].
  dense = [jnp.stack([jnp.pad(jnp.concatenate([x[b, :n], new[b]]), ((0, s - n - steps), (0, 0), (0, 0)))
                      for b, n in enumerate(ns)]).astype(jnp.bfloat16).astype(jnp.float32)
           for x, new in ((k, new_k), (v, new_v))]
  for hat, want, bound in zip(cache.dequantized(), dense, (0.8, 0.6)):
    for b, n in enumerate(ns):
      np.testing.assert_allclose(hat[b, :n, 0], 0.0, atol=1e-6)
      got, exp = hat[b, n:n + 3, 0], want[b, n:n + 3, 0]  # decoded, then flushed
      assert float(jnp.linalg.norm(got - exp) / jnp.linalg.norm(exp)) < bound
  ref = _visible_attention(qs[:, -1:], *dense, jnp.array(ns) + steps)
  got, ref = np.asarray(o, np.float32)[:, 0, :G], np.asarray(ref)[:, 0, :G]  # the query heads of kv head 0
  assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 0.5


@pytest.mark.parametrize("name", ["oskvp", "oskvp_uniform"])
def test_prefill_nan_in_the_compressed_store_comes_back_nan(name):
  """A NaN key or value written at prefill into the compressed store (token 3 of 300: window 128, so n_comp = 256)
  makes that kv head's decode output NaN, as the bf16 cache's does, and leaves the other heads and rows finite: the
  fit leaves the row out of its statistics, and its fp8 outlier channels carry the NaN (the int8 / KIVI quantizers
  used to hide such a NaN, test_baselines)."""
  k, v = kv(jax.random.key(11), 300)
  new, q = kv(jax.random.key(12), 1)[0], jax.random.normal(jax.random.key(13), (B, 1, K * G, H))
  lengths = jnp.array([300, 300])
  mode = get_kv_cache_mode(name)
  prefill = jax.jit(lambda k, v: mode.from_prefill(k, v, lengths, 512, layer=0))
  step = jax.jit(lambda c, q, kk, vv: c.extend(q, kk, vv, lengths))
  for kk, vv in ((k.at[0, 3, 0, 5].set(jnp.nan), v), (k, v.at[0, 3, 0, 5].set(jnp.nan))):
    cache = prefill(kk, vv)
    assert int(cache.n_comp[0]) == 256
    o, _ = step(cache, q, new, new)
    nan = np.isnan(np.asarray(o, np.float32)).any(-1)[:, 0]  # [B, N]
    np.testing.assert_array_equal(nan, [[True] * G + [False] * G, [False] * (K * G)])



@functools.partial(jax.jit, static_argnums=(0, 1))
def _biased_kv(t, h, key_bias, value_bias):
  """Keys [B, t, K, h] with an outlier channel h/2 - 2 (std 5; a slow RoPE pair, so the bias stays nearly constant
  over t tokens) biased by key_bias before RoPE at positions 0..t-1, and unit values biased by value_bias on
  channel 9: projections with biases."""
  k = jax.random.normal(jax.random.PRNGKey(5), (B, t, K, h)) * jnp.ones(h).at[h // 2 - 2].set(5.0)
  k = rope(k.at[..., h // 2 - 2].add(key_bias), jnp.broadcast_to(jnp.arange(t), (B, t)), 1e4)
  return k, jax.random.normal(jax.random.PRNGKey(6), (B, t, K, h)).at[..., 9].add(value_bias)


@pytest.mark.parametrize("implementation,uniform,head_dim", [("xla", False, 64), ("pallas", False, 64),
                                                              ("pallas", True, 128)])
def test_biased_keys_and_values_decode_as_well_as_unbiased_ones(implementation, uniform, head_dim):
  """Keys biased by 30 standard deviations of their outlier channel (150, before RoPE) and values by 30 on a channel,
  prompts of 140 and 130 tokens (more than head_dim: fitted, not the short-prompt fallback), 3 tokens decoded: the
  decode output's error against dense attention over the bf16 tokens is within 1.05x of the unbiased cache's
  (measured 0.97-1.03x). Before the fp8 outlier channels were stored about their centres, 1.20-1.25x. (With
  prompts shorter than head_dim the fallback takes the biased rows' magnitude for their spread, 8.7-10.5x, until
  the first flush refits them: `test_a_prompt_inside_the_window_is_refitted_at_its_first_flush`.) Pallas runs in
  interpret mode (uniform at H=128: the Mosaic GPU core through its interpreter). `NO_REFIT`."""
  if implementation == "pallas":
    pytest.importorskip("pallas_kernels.oskvp_decode_attention")
  steps, ns, s = 3, [T64, 130], S64
  t = ns[0] + steps
  qs = jax.random.normal(jax.random.PRNGKey(3), (B, 1, K * G, head_dim))
  mode = OSKVPMode(window=R, implementation=implementation, uniform=uniform, **NO_REFIT)
  total = jnp.array(ns) + steps
  errs = []
  for key_bias, value_bias in ((0.0, 0.0), (150.0, 30.0)):
    k, v = _biased_kv(t, head_dim, key_bias, value_bias)
    cache = _prefill(k[:, :ns[0]], v[:, :ns[0]], jnp.array(ns), mode=mode, cache_len=s)
    assert cache.runs_mosaic_core(K * G) == (uniform and implementation == "pallas")
    for i in range(steps):  # decoded tokens written after each row's prompt
      idx = (jnp.array(ns) + i)[:, None, None, None]
      o, cache = _extend(cache, qs, jnp.take_along_axis(k, idx, 1), jnp.take_along_axis(v, idx, 1))
    dense = [jnp.where((jnp.arange(t) < total[:, None])[:, :, None, None], x, 0.0)
             .astype(jnp.bfloat16).astype(jnp.float32) for x in (k, v)]
    ref = np.asarray(_visible_attention(qs, *dense, total))
    got = np.asarray(o, np.float32)
    assert np.isfinite(got).all()
    errs.append(float(np.linalg.norm(got - ref)))  # the bias moves the output, not its spread: absolute error
  assert errs[1] < 1.05 * errs[0], errs


@pytest.mark.parametrize("uniform,ns", [(False, (3, 50)), (True, (3, 50)), (False, (3, 30))])
def test_a_prompt_inside_the_window_is_refitted_at_its_first_flush(uniform, ns):
  """Window R = 40 >= H, keys and values biased by 30 sds (`_biased_kv`). The 3-token row's whole prompt sits in the
  window (nothing coded at prefill), so at its first flush (decode step 37) U, codebooks and fp8 scales are fitted
  again on the window's 40 tokens. With a 50-token row beside it, that row had 40 tokens coded at prefill and keeps
  its prefill fit through its flush (step 30); with a 30-token row instead, no row is fitted at prefill (identity U,
  the window holds the bf16 tokens themselves, `oskvp.placeholder`) and each is fitted at its own first flush (steps
  37 and 10). Every step's output equals attention over the cache's own dequantized tokens (a refitted row's window
  re-rotated consistently), and over the 9 steps after the refit the 3-token row's error against dense attention is
  < 0.1x the unrefitted cache's (measured 0.045x, 0.040x uniform, 0.045x deferred: the short-prompt fallback had
  levels as wide as the bias)."""
  steps, s, r = 46, 128, 40
  deferred = max(ns) <= r
  t = max(ns) + steps
  k, v = _biased_kv(t, H, 150.0, 30.0)
  qs = jax.random.normal(jax.random.PRNGKey(3), (B, steps, K * G, H))
  errs = {}
  for refit in (True, False):
    mode = OSKVPMode(window=r, uniform=uniform, refit_at_first_flush=refit)
    # Prompts zero-padded to 50 tokens: ns (3, 30) runs the prefill programs of (3, 50).
    cache = _prefill(_pad(k[:, :max(ns)], 50), _pad(v[:, :max(ns)], 50), jnp.array(ns), mode=mode, cache_len=s)
    if refit:
      np.testing.assert_array_equal(cache.refit, [True, deferred])
      if deferred:  # no fit at prefill: the window holds the tokens themselves
        np.testing.assert_array_equal(cache.u_k, np.broadcast_to(np.eye(H), cache.u_k.shape))
        np.testing.assert_array_equal(cache.res_k[1, :, :30], jnp.swapaxes(k[1, :30], 0, 1).astype(jnp.bfloat16))
    u0 = np.asarray(cache.u_k)
    errs[refit] = []
    for i in range(steps):
      idx = (jnp.array(ns) + i)[:, None, None, None]
      o, cache = _extend(cache, qs[:, i:i + 1], jnp.take_along_axis(k, idx, 1), jnp.take_along_axis(v, idx, 1))
      total = jnp.array(ns) + i + 1
      if refit:
        np.testing.assert_allclose(o, _visible_attention(qs[:, i:i + 1], *cache.dequantized(), total), rtol=1e-4,
                                   atol=1e-4)
      if i >= 37:
        dense = [jnp.where((jnp.arange(t) < total[:, None])[:, :, None, None], x, 0.0)
                 .astype(jnp.bfloat16).astype(jnp.float32) for x in (k, v)]
        errs[refit].append(float(jnp.linalg.norm(o[0] - _visible_attention(qs[:, i:i + 1], *dense, total)[0])))
    np.testing.assert_array_equal(cache.n_comp, [40, 40 if deferred else 80])
    if refit:
      np.testing.assert_array_equal(cache.refit, [False, False])
      for row in range(B):
        u = np.asarray(cache.u_k[row], np.float64)
        np.testing.assert_allclose(np.einsum("khi,khj->kij", u, u), np.broadcast_to(np.eye(H), (K, H, H)),
                                   atol=1e-4)
        if row == 0 or deferred:
          assert not np.allclose(u, u0[row])  # refitted
        else:
          np.testing.assert_array_equal(u, u0[row])  # the prefill's fit kept
  assert np.mean(errs[True]) < 0.1 * np.mean(errs[False]), errs


def test_symmetric_3bit_keys_stay_symmetric_from_short_prompts_through_the_refit():
  """`oskvp_k3v2_sym`: 8-level key codebooks symmetric about one centre (what the kernel's four-type form needs) for
  a long prompt, a 2-token prompt (the fallback levels) and after the refit at the first flush. (The 2-token prompts
  are zero-padded to 300 tokens: one prefill program.)"""
  h = 64
  k, v = _outlier_kv(300, h)
  mode = OSKVPMode(window=R, key_bits=3, symmetric=True)
  c = _prefill(k, v, jnp.array([300, 2]), mode=mode, cache_len=320)
  assert c.cb_k.shape[-1] == 8 and oskvp.symmetric_codebooks(c.cb_k) and oskvp.symmetric_codebooks(c.cb_v)
  short = _prefill(_pad(k[:, :2], 300), _pad(v[:, :2], 300), jnp.array([2, 2]), mode=mode, cache_len=320)
  q = jax.random.normal(jax.random.PRNGKey(3), (B, 1, K * G, h))
  step = jax.jit(lambda c, q, kk, vv: c.extend(q, kk, vv, c.n_comp + c.n_res)[1])
  for t in range(R + 1):  # past the window: the first flush refits the short rows
    short = step(short, q, k[:, 2 + t:3 + t], v[:, 2 + t:3 + t])
  assert int(short.n_comp.min()) > 0
  assert oskvp.symmetric_codebooks(short.cb_k) and oskvp.symmetric_codebooks(short.cb_v)
  assert not oskvp.symmetric_codebooks(np.sort(np.random.default_rng(0).standard_normal((4, 8)), axis=-1))
