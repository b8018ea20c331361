"""Prefill / decode_step / generate on the tiny model: incremental decoding equals the full pass, ragged batches
equal per-sequence runs, bad input is rejected with a clear error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import decode
from moe_jax.generate import generate, pad_batch, prompt_cache_len, stream
from moe_jax.sampling import SamplingParams, sample, sorted_candidates


def _rand_tokens(shape, vocab=256, seed=0):
  """Seeded, so a test's tokens do not depend on which tests ran before it in the same worker: with the global
  numpy RNG, one CI ordering drew a sequence where bf16 rounding flipped a near-tie top-k routing decision (a
  0.17 relative logit error at one step of test_bf16_cache_tracks_fp32; seeds 0-11 give at most 2.4e-3)."""
  return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def test_incremental_decode_equals_full_forward_64_steps(tiny_model):
  b, prompt, steps = 2, 5, 64
  toks = _rand_tokens((b, prompt + steps))
  full = np.asarray(decode.logits(tiny_model, toks))
  out, cache = decode.prefill(tiny_model, toks[:, :prompt], np.full(b, prompt), kv_cache="fp32",
                              cache_len=prompt + steps)
  np.testing.assert_allclose(np.asarray(out), full[:, :prompt], rtol=1e-4, atol=1e-4)
  for t in range(prompt, prompt + steps):
    step, cache = decode.decode_step(tiny_model, cache, toks[:, t])
    np.testing.assert_allclose(np.asarray(step), full[:, t], rtol=1e-4, atol=1e-4, err_msg=f"step {t}")
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt + steps)


def test_bf16_cache_tracks_fp32(tiny_model):
  toks = _rand_tokens((1, 24))
  full = np.asarray(decode.logits(tiny_model, toks))
  _, cache = decode.prefill(tiny_model, toks[:, :8], [8], kv_cache="bf16", cache_len=24)
  for t in range(8, 24):
    step, cache = decode.decode_step(tiny_model, cache, toks[:, t])
    rel = np.linalg.norm(np.asarray(step) - full[:, t]) / np.linalg.norm(full[:, t])
    assert rel < 2e-2, (t, rel)  # bf16 keys/values: ~3 significant digits


def test_ragged_batch_equals_per_sequence_runs(tiny_model):
  """Padded with an id outside the vocabulary (before: its NaN embedding reached the short rows' valid logits
  through attention, and they generated all zeros)."""
  prompts = [list(_rand_tokens((n,), seed=n)) for n in (3, 11, 1, 7)]
  tokens, lengths = pad_batch(prompts, pad_id=1000)
  logits, _ = decode.prefill(tiny_model, tokens, lengths, kv_cache="fp32", cache_len=32)
  assert np.isfinite(np.asarray(logits)).all()
  key = jax.random.key(0)
  batched = generate(tiny_model, tokens, lengths, key=key, max_new_tokens=12, kv_cache="fp32", cache_len=32)
  for i, p in enumerate(prompts):
    t1 = np.full((1, tokens.shape[1]), 256, np.int32)  # same padded width: one compiled shape for all runs
    t1[0, : len(p)] = p
    l1 = np.array([len(p)], np.int32)
    alone = generate(tiny_model, t1, l1, key=key, max_new_tokens=12, kv_cache="fp32", cache_len=32)
    np.testing.assert_array_equal(np.asarray(batched.tokens[i]), np.asarray(alone.tokens[0]))


def test_generate_greedy_matches_argmax_loop_and_stream(tiny_model):
  tokens, lengths = pad_batch([list(_rand_tokens((6,), seed=1)), list(_rand_tokens((4,), seed=2))])
  out = generate(tiny_model, tokens, lengths, key=jax.random.key(1), max_new_tokens=10, kv_cache="fp32")
  streamed = np.stack(list(stream(tiny_model, tokens, lengths, key=jax.random.key(1), max_new_tokens=10,
                                  kv_cache="fp32")), axis=1)
  np.testing.assert_array_equal(np.asarray(out.tokens), streamed)
  # Manual argmax loop over full causal passes (one fixed padded shape: later positions cannot affect earlier ones).
  buf = np.zeros((2, 16), np.int32)
  buf[:, :6] = tokens
  n = lengths.copy()
  for _ in range(10):
    nxt = np.argmax(np.asarray(decode.logits(tiny_model, buf))[np.arange(2), n - 1], -1)
    buf[np.arange(2), n] = nxt
    n += 1
  np.testing.assert_array_equal(np.asarray(out.tokens), np.stack([buf[i, lengths[i]:lengths[i] + 10]
                                                                  for i in range(2)]))


def test_generate_stops_at_eos(tiny_model):
  tokens, lengths = pad_batch([list(_rand_tokens((5,)))])
  first = generate(tiny_model, tokens, lengths, key=jax.random.key(0), max_new_tokens=8, kv_cache="fp32")
  stop = int(first.tokens[0, 3])  # Treat the 4th generated token as EOS: generation must stop right there.
  out = generate(tiny_model, tokens, lengths, key=jax.random.key(0), max_new_tokens=8, kv_cache="fp32", eos_id=stop)
  n = int(out.lengths[0])
  assert n == 1 + int(np.argmax(np.asarray(first.tokens[0]) == stop))
  assert np.all(np.asarray(out.tokens[0, n:]) == 256)


def test_sampling_top_k_one_and_tiny_top_p_are_greedy():
  logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3
  greedy = np.argmax(np.asarray(logits), -1)
  ones = jnp.ones(64)
  for top_k, top_p in ((1, 1.0), (0, 1e-6)):
    tok = sample(logits, jax.random.key(1), ones, jnp.full(64, top_k, jnp.int32), jnp.full(64, top_p))
    np.testing.assert_array_equal(np.asarray(tok), greedy)


def test_sampling_params_take_numpy_scalars_and_top_p_one_keeps_every_token():
  """np.float32 / np.int64 settings (a notebook sweep over np.linspace) were refused; a bool temperature passed.
  top_p = 1 dropped tail tokens once float32's running sum reached 1.0."""
  p = SamplingParams(temperature=np.float32(0.7), top_k=np.int64(5), top_p=np.float32(0.9))
  assert (type(p.temperature), type(p.top_k), type(p.top_p)) == (float, int, float) and p.top_k == 5
  with pytest.raises(ValueError, match="temperature=True"):
    SamplingParams(temperature=True)
  logits = jnp.concatenate([jnp.full((1, 1), 30.0), jnp.zeros((1, 63))], axis=1)  # tail mass ~1e-13 per token
  _, cand = sorted_candidates(logits, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1))
  assert np.isfinite(np.asarray(cand)).all()
  _, cand = sorted_candidates(logits, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.full(1, 0.5))
  assert np.isfinite(np.asarray(cand)).sum() == 1


def test_top_k_keeps_the_most_likely_tokens_at_any_temperature():
  """At a temperature of 1e38 the scaled logits all round to 0; top-k ranked them by vocabulary index and drew only
  the two least likely tokens here. It ranks by the logits now, the same order for every temperature > 0."""
  logits = jnp.array([[-10.0, -10.0, 5.0, 4.0]])
  for t in (1.0, 1e30, 1e38):
    order, cand = sorted_candidates(logits, jnp.full(1, t), jnp.full(1, 2, jnp.int32), jnp.ones(1))
    assert set(np.asarray(order[0, :2]).tolist()) == {2, 3} and np.isfinite(np.asarray(cand)).sum() == 2, t
    draws = {int(sample(logits, jax.random.key(i), jnp.full(1, t), jnp.full(1, 2, jnp.int32), jnp.ones(1))[0])
             for i in range(20)}
    assert draws <= {2, 3}, (t, draws)


@pytest.mark.parametrize("top_p", [1.0, 0.999])  # the whole-row draw and the sorted candidates
def test_temperatures_under_1e_6_are_taken_as_given(top_p):
  """Two logits one float32 ulp apart at 10 (9.5e-7): at T = 1e-6 the lower is drawn with probability
  1 / (1 + e^0.954) = 0.278, at T = 1e-7 with 7e-5 (greedy in the limit). Before, any T under 1e-6 was taken as 1e-6."""
  hi = np.nextafter(np.float32(10.0), np.float32(11.0))
  logits = jnp.asarray([[10.0, hi]], jnp.float32)
  keys = jax.random.split(jax.random.key(3), 4000)
  for t, p_low, tol in ((1e-6, 1 / (1 + np.exp((hi - 10.0) / 1e-6)), 0.03), (1e-7, 0.0, 0.002)):
    draw = jax.vmap(lambda k, t=t: sample(logits, k, jnp.full(1, t), jnp.zeros(1, jnp.int32), jnp.full(1, top_p)))(keys)
    assert abs(float(np.mean(np.asarray(draw) == 0)) - p_low) <= tol, (t, float(np.mean(np.asarray(draw) == 0)))


def test_sampling_follows_the_distribution():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  n = 20000
  keys = jax.random.split(jax.random.key(7), n)
  draw = jax.vmap(lambda k: sample(logits, k, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1))[0])(keys)
  freq = np.bincount(np.asarray(draw), minlength=4) / n
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)  # ~4 sigma at n=20000
  # top_k=2 renormalises over the two most likely tokens.
  draw = jax.vmap(lambda k: sample(logits, k, jnp.ones(1), jnp.full(1, 2, jnp.int32), jnp.ones(1))[0])(keys)
  freq = np.bincount(np.asarray(draw), minlength=4) / n
  np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.015)


def test_sampling_rows_that_filter_and_rows_that_do_not_share_a_batch():
  """A row without top-k / top-p (drawn over the whole row, no sort, when no row of the batch filters) keeps its
  distribution when it shares a batch with a filtering row (the batch then takes the sorted draw); top_k >= V and
  greedy rows filter nothing."""
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 3))
  n = 20000
  keys = jax.random.split(jax.random.key(8), n)
  for top_k in ([0, 2, 0], [4, 0, 0]):  # row 1 filters (top_k 2) or none does (top_k 4 = V; row 2 greedy)
    temp, k = jnp.array([1.0, 1.0, 0.0]), jnp.array(top_k, jnp.int32)
    draw = np.asarray(jax.vmap(lambda key, t=temp, k=k: sample(logits, key, t, k, jnp.ones(3)))(keys))
    freq = [np.bincount(draw[:, i], minlength=4) / n for i in range(3)]
    np.testing.assert_allclose(freq[0], [0.5, 0.3, 0.15, 0.05], atol=0.015)
    np.testing.assert_allclose(freq[1], [0.625, 0.375, 0, 0] if top_k[1] == 2 else [0.5, 0.3, 0.15, 0.05],
                               atol=0.015)
    np.testing.assert_array_equal(freq[2], [1, 0, 0, 0])
  # With one key, a row that filters nothing draws the same token whether or not another row of its batch filters.
  alone = jax.vmap(lambda key: sample(logits, key, jnp.array([1.0, 1.0, 0.0]), jnp.zeros(3, jnp.int32),
                                      jnp.ones(3)))(keys[:500])
  beside = jax.vmap(lambda key: sample(logits, key, jnp.array([1.0, 1.0, 0.0]), jnp.array([0, 2, 0], jnp.int32),
                                       jnp.ones(3)))(keys[:500])
  np.testing.assert_array_equal(np.asarray(alone)[:, 0], np.asarray(beside)[:, 0])


@pytest.mark.parametrize("tokens, lengths, cache_len, max_new, match", [
    ([[1, 2, 3]], [3], 4, 3, "prompt too long"),  # 3 + 3 - 1 = 5 positions (2 new tokens fit: the last is not fed)
    ([[1, 2, 3]], [0], 8, 1, "empty prompt"),
    ([[1, 999, 3]], [3], 8, 1, "outside the vocabulary"),
    ([[1, -1, 3]], [3], 8, 1, "outside the vocabulary"),
    ([[1, 2, 3]], [4], 8, 1, "lengths"),
    ([1, 2, 3], [3], 8, 1, "tokens must be"),
])
def test_bad_prompts_raise_clear_errors(tiny_model, tokens, lengths, cache_len, max_new, match):
  with pytest.raises(ValueError, match=match):
    generate(tiny_model, np.array(tokens), np.array(lengths), key=jax.random.key(0), max_new_tokens=max_new,
             cache_len=cache_len)


@pytest.mark.parametrize("kwargs, field", [(dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                           (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params(kwargs, field):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kwargs)


def test_unknown_kv_cache_mode(tiny_model):
  with pytest.raises(ValueError, match="kv_cache"):
    decode.prefill(tiny_model, np.ones((1, 2), np.int32), [2], kv_cache="int3", cache_len=4)


@pytest.mark.parametrize("prompt, max_new, cache_len, match", [
    (3005, 32, 0, r"^--prompt is 3005 tokens; with --max_new_tokens=32 that needs 3036 positions, more than "
                  r"max_seq_len=1024 of config 'tiny': shorten the prompt to at most 993 tokens"),
    (1000, 32, 0, r"^--prompt is 1000 tokens; .* 1031 positions, more than max_seq_len=1024"),
    (10, 2000, 0, r"^--prompt is 10 tokens; .* --max_new_tokens must be at most 1024"),
    (10, 32, 20, r"^--prompt is 10 tokens; .* more than --cache_len=20"),
    (10, 32, 2000, r"^--cache_len=2000 exceeds max_seq_len=1024"),
])
def test_the_generate_cli_names_a_prompt_that_does_not_fit(tiny_config, prompt, max_new, cache_len, match):
  # The CLI checks the prompt before deriving a cache length the user never gave (it used to report cache_len=3037).
  with pytest.raises(ValueError, match=match):
    prompt_cache_len(tiny_config, prompt, max_new_tokens=max_new, cache_len=cache_len)
  assert prompt_cache_len(tiny_config, 993, max_new_tokens=32) == 1024
  assert prompt_cache_len(tiny_config, 1024, max_new_tokens=1) == 1024  # a full-length prompt gets its next token
  assert prompt_cache_len(tiny_config, 10, max_new_tokens=32, cache_len=64) == 64


def test_the_last_new_token_needs_no_cache_position(tiny_model):
  """prompt + max_new_tokens - 1 positions suffice (before, one more was required: a prompt of max_seq_len tokens could
  not get even one token); generate and stream agree there."""
  tokens, lengths = np.asarray(_rand_tokens((2, 6), seed=5)), np.array([6, 6], np.int32)
  logits, _ = decode.prefill(tiny_model, tokens, lengths, kv_cache="fp32", cache_len=6)
  one = generate(tiny_model, tokens, lengths, key=jax.random.key(0), max_new_tokens=1, kv_cache="fp32", cache_len=6)
  np.testing.assert_array_equal(np.asarray(one.tokens[:, 0]), np.argmax(np.asarray(logits)[:, -1], -1))
  out = generate(tiny_model, tokens, lengths, key=jax.random.key(0), max_new_tokens=4, kv_cache="fp32", cache_len=9)
  streamed = np.stack(list(stream(tiny_model, tokens, lengths, key=jax.random.key(0), max_new_tokens=4,
                                  kv_cache="fp32", cache_len=9)), axis=1)
  np.testing.assert_array_equal(np.asarray(out.tokens), streamed)
  with pytest.raises(ValueError, match="prompt too long"):
    generate(tiny_model, tokens, lengths, key=jax.random.key(0), max_new_tokens=5, kv_cache="fp32", cache_len=9)


def test_cache_len_beyond_model_limit(tiny_model, tiny_config):
  with pytest.raises(ValueError, match="max_seq_len"):
    decode.validate_prompts(tiny_config, np.ones((1, 2), np.int32), [2], cache_len=tiny_config.max_seq_len + 1)


@pytest.mark.parametrize("kwargs, message", [(dict(cache_len=8, max_new_tokens=-1), "max_new_tokens=-1 must be"),
                                             (dict(cache_len=0), "cache_len=0 must be"),
                                             (dict(cache_len=4.0), "cache_len=4.0 must be")])
def test_bad_lengths_are_named(tiny_config, kwargs, message):
  with pytest.raises(ValueError, match=message):
    decode.validate_prompts(tiny_config, np.ones((1, 2), np.int32), [2], **kwargs)


@pytest.mark.parametrize("kv_cache", ["fp32", "int8", "kivi2"])
def test_a_decode_step_past_a_full_cache_is_nan_not_wrong(tiny_model, kv_cache):
  """cache_len = 6 for prompts of 6 and 4: the first row's step has no position (its logits are NaN: before, the dense
  caches dropped the token and the logits were 7.3 off), the second row's steps stay exact. kivi2 stores 32
  positions (a multiple of its group) but holds the 6 asked for (before, its guard fired only at 32)."""
  tokens = np.asarray(_rand_tokens((2, 6), seed=3))
  lengths = np.array([6, 4], np.int32)
  _, cache = decode.prefill(tiny_model, tokens, lengths, kv_cache=kv_cache, cache_len=6)
  assert cache.max_len == 6
  step, _ = decode.decode_step(tiny_model, cache, np.array([5, 7], np.int32))
  step = np.asarray(step)
  assert np.isnan(step[0]).all() and np.isfinite(step[1]).all()
  full = np.asarray(decode.logits(tiny_model, np.concatenate([tokens[1:, :4], [[7]]], axis=1)))[0, -1]
  np.testing.assert_allclose(step[1], full, atol=1e-4 if kv_cache == "fp32" else 0.05)


def test_prefill_checks_concrete_prompts_by_name(tiny_model):
  with pytest.raises(ValueError, match="tokens must be integers, got dtype float32"):
    decode.prefill(tiny_model, np.ones((1, 3), np.float32), [3], cache_len=8)
  with pytest.raises(ValueError, match=r"lengths=\[5\] exceed the token array's length 3"):
    decode.prefill(tiny_model, np.ones((1, 3), np.int32), [5], cache_len=8)
  with pytest.raises(ValueError, match="tokens has 10 positions but cache_len=8"):
    decode.prefill(tiny_model, np.ones((1, 10), np.int32), [3], cache_len=8)


def test_decode_step_names_a_token_batch_that_is_not_the_caches(tiny_model):
  _, cache = decode.prefill(tiny_model, np.ones((2, 3), np.int32), [3, 3], cache_len=8)
  with pytest.raises(ValueError, match=r"tokens must be an integer array of shape \(2,\).*int32 \(3,\)"):
    decode.decode_step(tiny_model, cache, np.ones((3,), np.int32))
  with pytest.raises(ValueError, match=r"got float32 \(2,\)"):
    decode.decode_step(tiny_model, cache, np.ones((2,), np.float32))


def test_decode_step_names_a_host_token_outside_the_vocabulary(tiny_model):
  _, cache = decode.prefill(tiny_model, np.ones((2, 3), np.int32), [3, 3], cache_len=8)
  bad = tiny_model.config.vocab_size
  with pytest.raises(ValueError, match=rf"token id {bad} at tokens\[1\] is outside the vocabulary"):
    decode.decode_step(tiny_model, cache, np.array([1, bad], np.int32))  # before: NaN logits for row 1
  with pytest.raises(ValueError, match=r"token id -1 at tokens\[0\]"):
    decode.decode_step(tiny_model, cache, np.array([-1, 1], np.int64))
  step, _ = decode.decode_step(tiny_model, cache, np.array([0, bad - 1], np.int32))  # the vocabulary's two ends
  assert np.isfinite(np.asarray(step)).all()


def test_logits_names_bad_tokens(tiny_model):
  with pytest.raises(ValueError, match=r"tokens must be an integer array \[batch, length\], got float32"):
    decode.logits(tiny_model, jnp.ones((1, 3), jnp.float32))  # before: "indices must have an integer type"
  with pytest.raises(ValueError, match=r"tokens must be an integer array \[batch, length\], got int32 \(3,\)"):
    decode.logits(tiny_model, jnp.ones((3,), jnp.int32))  # before: IndexError in model.py
  with pytest.raises(ValueError, match=r"token id 9999 at tokens\[0, 1\] is outside the vocabulary"):
    decode.logits(tiny_model, jnp.asarray([[1, 9999]]))  # before: silent NaN logits
  too_long = tiny_model.config.max_seq_len + 1
  with pytest.raises(ValueError, match=rf"tokens has length {too_long} > max_seq_len="):
    decode.logits(tiny_model, jnp.ones((1, too_long), jnp.int32))


def test_prefill_names_float_lengths_and_a_zero_cache_len(tiny_model):
  with pytest.raises(ValueError, match=r"lengths must be integers of shape \(2,\), got float64"):
    decode.prefill(tiny_model, np.ones((2, 3), np.int32), np.array([3.0, 2.5]), cache_len=8)  # before: truncated
  with pytest.raises(ValueError, match="cache_len=0 must be an int >= 1"):
    decode.prefill(tiny_model, np.ones((1, 3), np.int32), [3], cache_len=0)  # before: max_seq_len silently


def test_decode_step_names_a_cache_of_another_model(tiny_model, tiny_config):
  _, cache = decode.prefill(tiny_model, np.ones((2, 3), np.int32), [3, 3], cache_len=8)
  other = decode.init_model(dataclasses.replace(tiny_config, n_layers=1))
  with pytest.raises(ValueError, match="cache has 2 layers but the model has 1"):  # before: silently ran 1 layer
    decode.decode_step(other, cache, np.ones((2,), np.int32))
  with pytest.raises(TypeError, match=r"tokens must be an integer array \[B\], got a list"):  # before: AttributeError
    decode.decode_step(tiny_model, cache, [1, 2])
  for mode in ("bf16", "int8", "kivi2", "oskvp"):  # before: an einsum or broadcasting error inside XLA
    wide = decode.init_model(dataclasses.replace(tiny_config, n_kv_heads=4))
    _, cache = decode.prefill(wide, np.ones((2, 3), np.int32), [3, 3], kv_cache=mode, cache_len=8)
    with pytest.raises(ValueError, match="cache layer 0 holds 4 kv heads of dim 32 but the model has 2 of dim 32"):
      decode.decode_step(tiny_model, cache, np.ones((2,), np.int32))


def test_generate_takes_a_numpy_integer_max_new_tokens(tiny_model):
  out = generate(tiny_model, np.ones((1, 2), np.int32), [2], key=jax.random.key(0), max_new_tokens=np.int64(2))
  assert out.tokens.shape == (1, 2)


def test_generate_and_stream_take_a_flat_model_and_name_bad_arguments(tiny_model):
  """`FlatModel.of(model)` (the README: every entry point takes one) failed inside generate's jitted loop with an
  AttributeError; 1-D tokens gave an IndexError and stream's max_new_tokens=0 a message about cache_len."""
  from moe_jax.flat_model import FlatModel  # pylint: disable=g-import-not-at-top
  toks, key = np.array([[3, 4, 5]], np.int32), jax.random.key(0)
  out = generate(FlatModel.of(tiny_model), toks, [3], key=key, max_new_tokens=3)
  np.testing.assert_array_equal(out.tokens, generate(tiny_model, toks, [3], key=key, max_new_tokens=3).tokens)
  for run in (generate, lambda *a, **k: list(stream(*a, **k))):
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\], got shape \(3,\)"):
      run(tiny_model, toks[0], [3], key=key, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
      run(tiny_model, toks, [3], key=key, max_new_tokens=0)


def test_generate_names_an_eos_id_outside_the_vocabulary(tiny_model, tiny_config):
  vocab = tiny_config.vocab_size
  with pytest.raises(ValueError, match=rf"eos_id=-5 must be None or a token id in \[0, vocab_size={vocab}\)"):
    generate(tiny_model, np.ones((1, 2), np.int32), [2], key=jax.random.key(0), max_new_tokens=2, eos_id=-5)


def test_gradients_through_compressed_caches_are_refused_by_name(tiny_model):
  """Before, a gradient through an int8 / fp8 / kivi2 / oskvp cache was silently unrelated to the dense one (cosine
  0.006-0.31 against fp32 on a 160-token prompt: rounding has zero derivative, fp8 casts flushed the cotangents,
  OS-KVP's per-sequence fit was differentiated). Dense caches differentiate as before."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
  lengths = jnp.array([12, 9], jnp.int32)

  def loss(model, kv_cache):
    _, cache = decode.prefill(model, tokens, lengths, kv_cache=kv_cache, cache_len=16)
    logits, _ = decode.decode_step(model, cache, jnp.array([1, 2], jnp.int32))
    return jnp.sum(logits ** 2)

  grad = nnx.jit(nnx.grad(loss), static_argnums=1)  # one compiled program (op by op, the forward took ~20 s)
  grads = grad(tiny_model, "fp32")
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
  for mode in ("int8", "kivi2"):  # refused while the backward pass is traced, before anything compiles
    with pytest.raises(ValueError, match="a gradient reached a compressed KV cache .* inference-only"):
      grad(tiny_model, mode)


def test_convenience_inputs_and_checks_under_jit(tiny_model):
  """Lists for `logits` (as `prefill` takes them), scalar sampling parameters, and the dense cache's length check
  under jit (before: a TypeError, an IndexError, and a jnp.pad error)."""
  tokens = [[5, 6, 7, 8], [9, 10, 11, 12]]
  np.testing.assert_array_equal(decode.logits(tiny_model, tokens), decode.logits(tiny_model, np.asarray(tokens)))
  logits = jax.random.normal(jax.random.key(0), (3, 264))
  key = jax.random.key(1)
  want = sample(logits, key, jnp.full((3,), 0.7), jnp.full((3,), 5, jnp.int32), jnp.full((3,), 0.9))
  np.testing.assert_array_equal(sample(logits, key, 0.7, 5, 0.9), want)

  @jax.jit
  def short(tokens):
    return decode.prefill(tiny_model, tokens, jnp.array([4, 4]), kv_cache="bf16", cache_len=3)

  with pytest.raises(ValueError, match="cache_len=3 is shorter than the prefill length 4"):
    short(jnp.asarray(tokens, jnp.int32))


def test_float16_model_runs_on_the_cpu_and_tracks_float32(tiny_model, tiny_config):
  """param_dtype="float16" with the float32 model's weights rounded to float16: the full pass, prefill into fp32 and
  bf16 caches and a few decode steps stay within 2e-2 of the float32 logits (|logits| ~ 5; measured <= 6e-3).
  Before, every entry point failed on the CPU: jax's attention asks dot_general for F16_F16_F32, which XLA's CPU
  backend refuses ("not supported by dot_general on CPU"); the attention now runs in float32 there."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model16 = decode.init_model(tiny_config.replace(param_dtype="float16"))
  nnx.update(model16, jax.tree.map(lambda a: a.astype(jnp.float16), nnx.state(tiny_model, nnx.Param)))
  assert model16.blocks[0].attn.wq[...].dtype == jnp.float16
  toks = _rand_tokens((2, 12), seed=3)
  lengths = np.array([8, 5], np.int32)
  full32, full16 = decode.logits(tiny_model, toks), decode.logits(model16, toks)
  assert full16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(full16), np.asarray(full32), atol=2e-2)
  for kv_cache in ("fp32", "bf16"):
    out = []
    for model in (tiny_model, model16):
      logits, cache = decode.prefill(model, toks[:, :8], lengths, kv_cache=kv_cache, cache_len=12)
      steps = [logits]
      for t in range(8, 11):
        step, cache = decode.decode_step(model, cache, toks[:, t])
        steps.append(step)
      out.append(steps)
    for i, (a, b) in enumerate(zip(*out)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-2, err_msg=f"{kv_cache=} step {i}")
  tokens = generate(model16, toks[:, :8], lengths, key=jax.random.key(0), max_new_tokens=3, kv_cache="fp32",
                    cache_len=12).tokens
  assert tokens.shape == (2, 3)


def test_last_only_prefill_and_the_serving_steps_run_the_lm_head_on_one_row_each(tiny_model, tiny_config):
  """`decode.prefill(last_only=True)` and the engine's prefill / extend steps give the logits at each row's last
  token (equal to the full [B, T, V] logits there, 1e-5) and their compiled programs hold no [B, T, V] array: before,
  the LM head ran on every position and the rows but one were thrown away (at qwen3's vocabulary and the engine's
  16 × 512 bucket, 5 GB of logits per prefill)."""
  from moe_jax.serving import steps  # pylint: disable=g-import-not-at-top
  b, t, v = 3, 24, tiny_config.vocab_size
  toks, lengths = _rand_tokens((b, t), seed=3), np.array([24, 1, 13], np.int32)
  full, ref_cache = decode.prefill(tiny_model, toks, lengths, kv_cache="fp32", cache_len=40)
  want = np.asarray(full)[np.arange(b), lengths - 1]
  last, cache = decode.prefill(tiny_model, toks, lengths, kv_cache="fp32", cache_len=40, last_only=True)
  np.testing.assert_allclose(np.asarray(last), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(cache.layers[0].k), np.asarray(ref_cache.layers[0].k), rtol=0, atol=0)
  flat = steps.FlatModel.of(tiny_model)
  last, cache = steps.prefill(flat, toks, lengths, kv_cache="fp32", cache_len=40)
  np.testing.assert_allclose(np.asarray(last), want, rtol=1e-5, atol=1e-5)
  chunk, valid = _rand_tokens((b, 8), seed=4), np.array([8, 3, 0], np.int32)
  ext_last, _ = steps.extend(flat, cache, chunk, valid, last)
  ref_logits, _ = jax.jit(lambda m, c, x: m.decode(c, x))(tiny_model, cache, chunk)
  want_ext = np.where((valid > 0)[:, None], np.asarray(ref_logits)[np.arange(b), np.maximum(valid - 1, 0)],
                      np.asarray(last))
  np.testing.assert_allclose(np.asarray(ext_last), want_ext, rtol=1e-5, atol=1e-5)
  full_text = decode._prefill.lower(tiny_model, jnp.asarray(toks), jnp.asarray(lengths), kv_cache="fp32",
                                    cache_len=40).as_text()
  assert f"{b}x{t}x{v}xf32" in full_text  # the check below can see such an array
  for text in (steps.prefill.lower(flat, toks, lengths, kv_cache="fp32", cache_len=40).as_text(),
               steps.extend.lower(flat, cache, chunk, valid, last).as_text(),
               decode._prefill.lower(tiny_model, jnp.asarray(toks), jnp.asarray(lengths), kv_cache="fp32",
                                     cache_len=40, last_only=True).as_text()):
    for rows in (f"{b}x{t}x{v}xf32", f"{b}x8x{v}xf32"):
      assert rows not in text


def test_a_donating_decode_step_reuses_the_cache_and_equals_the_copying_one(tiny_model):
  """`decode_step(donate=True)` (what `stream` uses) gives the same logits and cache as the default, and the cache it
  was given is deleted (its buffers became the new cache's), so a loop does not copy the cache every step."""
  toks, lengths = _rand_tokens((2, 6), seed=5), np.array([6, 2], np.int32)
  _, c0 = decode.prefill(tiny_model, toks, lengths, kv_cache="bf16", cache_len=16)
  _, c1 = decode.prefill(tiny_model, toks, lengths, kv_cache="bf16", cache_len=16)
  tok = jnp.array([3, 4], jnp.int32)
  want, want_cache = decode.decode_step(tiny_model, c0, tok)
  got, got_cache = decode.decode_step(tiny_model, c1, tok, donate=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(c0))
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(c1.layers))


def test_a_flat_model_gives_the_modules_results_and_checks_without_rebuilding_it(tiny_model, monkeypatch):
  """`FlatModel.of(model)` through logits, prefill and decode_step (fp32 and oskvp caches) equals the module bit for
  bit; its checks read the config kept at `of` (no unflatten on the host per call), so a bad token is still named;
  and a later in-place change to the module is not seen (a snapshot, as documented)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from moe_jax.flat_model import FlatModel  # pylint: disable=g-import-not-at-top
  flat = FlatModel.of(tiny_model)
  assert FlatModel.of(flat) is flat and flat.config is tiny_model.config
  toks, lengths = _rand_tokens((2, 12), seed=5), np.array([12, 7], np.int32)
  np.testing.assert_array_equal(decode.logits(flat, toks), decode.logits(tiny_model, toks))
  for kv_cache in ("fp32", "oskvp"):
    la, ca = decode.prefill(tiny_model, toks, lengths, kv_cache=kv_cache, cache_len=24, last_only=True)
    lb, cb = decode.prefill(flat, toks, lengths, kv_cache=kv_cache, cache_len=24, last_only=True)
    np.testing.assert_array_equal(la, lb)
    nxt = np.asarray(jnp.argmax(la, -1), np.int32)
    np.testing.assert_array_equal(decode.decode_step(tiny_model, ca, nxt)[0], decode.decode_step(flat, cb, nxt)[0])
  monkeypatch.setattr(FlatModel, "unflatten", lambda self: pytest.fail("unflattened on the host"))
  with pytest.raises(ValueError, match="vocab"):
    decode.decode_step(flat, cb, np.array([1, 10**6], np.int32))
  monkeypatch.undo()
  changed = nnx.clone(tiny_model)
  flat_before = FlatModel.of(changed)
  changed.embedding[...] = changed.embedding[...] * 2.0
  assert not np.allclose(decode.logits(changed, toks), decode.logits(flat_before, toks))
