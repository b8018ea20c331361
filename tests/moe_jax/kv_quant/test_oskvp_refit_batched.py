"""Batched OS-KVP fits: one eigendecomposition for a layer's keys and values (`OSKVPMode.fit_keys_values`,
`oskvp.fit(evecs=...)`), and the refit at the first flush in chunks of rows (`OSKVPMode.refit_chunk`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.kv_cache import get_kv_cache_mode
from moe_jax.kv_quant import OSKVPMode, oskvp
from refit_checks import assert_same_refits  # pylint: disable=import-error  (this directory)

B, K, G, H, R, S = 5, 2, 2, 32, 40, 128


def _kv(t: int) -> tuple[jax.Array, jax.Array]:
  """Keys with two wide channels and a bias, values: [B, t, K, H]."""
  std = jnp.ones(H).at[jnp.array([3, 17])].set(6.0)
  k = jax.random.normal(jax.random.PRNGKey(0), (B, t, K, H)) * std + 0.3 * std
  return k, jax.random.normal(jax.random.PRNGKey(1), (B, t, K, H))


def _assert_params_close(a: oskvp.OSKVPParams, b: oskvp.OSKVPParams, tol: float = 1e-5) -> None:
  """U and fp8 scales within tol; codebooks within tol but for 2% of levels, which must be within 0.05 (levels are
  O(1) here): a Lloyd-Max step is discontinuous in its samples, so a sample on a cell's edge can land on the other
  side from a rounding difference in its rotation, and the two levels beside that edge move by up to about the
  sample's distance to them over the cell's count (R = 40 samples, ~10 a cell: 0.0134 measured for one such pair
  on the forty-second session's CPU, where XLA's rounding differed from earlier machines'). A wrong row's fit moves
  U and most levels by O(1)."""
  for name in ("u", "scale"):
    np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=tol, atol=tol, err_msg=name)
  diff = np.abs(np.asarray(a.codebook) - np.asarray(b.codebook))
  assert np.mean(diff > tol + tol * np.abs(np.asarray(b.codebook))) <= 0.02 and diff.max() < 0.05, diff.max()


def test_fit_with_given_eigenvectors_is_fit():
  """`fit(evecs=eigh(covariance(x, w)))` gives what `fit` gives, padding rows and a non-finite row left out alike;
  eigenvectors of the wrong shape are refused by name."""
  x = jax.random.normal(jax.random.PRNGKey(2), (200, H)) * jnp.linspace(0.2, 4.0, H)
  x = x.at[7].set(jnp.nan)
  w = (jnp.arange(200) < 180).astype(jnp.float32)
  _, evecs = jnp.linalg.eigh(oskvp.covariance(x, w))
  for kw in ({}, {"bits": 3}, {"symmetric": True}, {"uniform": True}):
    _assert_params_close(oskvp.fit(x, w, n_outlier=8, evecs=evecs, **kw), oskvp.fit(x, w, n_outlier=8, **kw))
  with pytest.raises(ValueError, match="evecs has shape"):
    oskvp.fit(x, w, n_outlier=8, evecs=evecs[:, :8])
  # The basis is the one supplied: identity eigenvectors (ascending) give U = the identity's columns reversed.
  np.testing.assert_array_equal(oskvp.fit(x, w, n_outlier=8, evecs=jnp.eye(H)).u, jnp.eye(H)[:, ::-1])


def test_fit_keys_values_makes_one_eigh_call(monkeypatch):
  """The point of `fit_keys_values`: one batched eigendecomposition where two `fit` calls make two."""
  calls = []
  eigh = jnp.linalg.eigh
  monkeypatch.setattr(jnp.linalg, "eigh", lambda a, *args, **kw: calls.append(a.shape) or eigh(a, *args, **kw))
  mode = OSKVPMode(window=R)
  k, v = _kv(48)
  lengths = jnp.full((B,), 48, jnp.int32)
  jax.eval_shape(lambda k, v: mode.fit_keys_values(k, v, lengths, rope_span=S), k, v)
  assert calls == [(B, 2 * K, H, H)]
  calls.clear()
  jax.eval_shape(lambda k, v: (mode.fit(k, lengths, rope_span=S), mode.fit(v, lengths)), k, v)
  assert len(calls) == 2


@pytest.mark.parametrize("name", ["oskvp", "oskvp_k3v2"])
def test_fit_keys_values_is_the_two_fits(name):
  """One batched eigh for keys (RoPE-shifted, `k_bits`) and values gives each side's `fit`, over ragged lengths."""
  mode = dataclasses.replace(get_kv_cache_mode(name), window=R)
  k, v = _kv(60)
  lengths = jnp.array([60, 45, 33, 50, 60])
  pk, pv = jax.jit(lambda k, v: mode.fit_keys_values(k, v, lengths, rope_span=S))(k, v)
  rk = jax.jit(lambda k: mode.fit(k, lengths, rope_span=S, bits=mode.k_bits))(k)
  rv = jax.jit(lambda v: mode.fit(v, lengths))(v)
  assert pk.codebook.shape[-1] == 2**mode.k_bits and pv.codebook.shape[-1] == 4
  _assert_params_close(pk, rk)
  _assert_params_close(pv, rv)


def test_refit_in_chunks_gives_each_row_its_own_fit():
  """Four short prompts (refit at their first flush) after a long one (row 0, which a chunk's padding repeats): three
  rows flush together at step 2 and one at step 4. With refit_chunk 1 (one row at a time), 2 (a chunk of two, then
  one row) and 8 (one chunk of min(B, 8) = 5 rows: 3 rows and 2 of padding) the caches and outputs agree; a refitted
  row's U and codebooks are those of a fit of its window alone (`OSKVPMode.fit`), the long row keeps its prefill
  fit, and each step attends as before."""
  lengths = jnp.array([100, R - 1, R - 1, R - 1, R - 3])
  steps = 5
  k, v = _kv(100 + steps)
  q = jax.random.normal(jax.random.PRNGKey(3), (B, steps, K * G, H))
  base = OSKVPMode(window=R)
  full = jnp.full((1,), R, jnp.int32)
  # A fit of one row's window alone (`OSKVPMode.fit` reads no refit_chunk: one program for all runs and rows).
  window_fit = jax.jit(lambda xk, xv: (base.fit(xk, full, rope_span=S, bits=base.k_bits), base.fit(xv, full)))
  runs = {}
  for chunk in (1, 2, 8):
    mode = dataclasses.replace(base, refit_chunk=chunk)
    cache = jax.jit(lambda k, v, m=mode: m.from_prefill(k, v, lengths, S, layer=0))(k[:, :100], v[:, :100])
    np.testing.assert_array_equal(cache.refit, [False, True, True, True, True])
    u_prefill = np.asarray(cache.u_k[0])
    step = jax.jit(lambda c, q, k, v: c.extend(q, k, v, jnp.zeros(B, jnp.int32)))
    outs, windows = [], {}
    for i in range(steps):
      if i in (1, 3):  # the step that flushes: each flushing row's window, in its original basis, before
        windows[i] = [jnp.einsum("BKRJ,BKHJ->BRKH", c.astype(jnp.float32), u)
                      for c, u in ((cache.res_k, cache.u_k), (cache.res_v, cache.u_v))]
      idx = (lengths + i)[:, None, None, None]
      o, cache = step(cache, q[:, i:i + 1], jnp.take_along_axis(k, idx, 1), jnp.take_along_axis(v, idx, 1))
      outs.append(o)
      if i == 1:
        np.testing.assert_array_equal(cache.refit, [False, False, False, False, True])
    np.testing.assert_array_equal(cache.refit, [False] * B)
    np.testing.assert_array_equal(cache.u_k[0], u_prefill)  # kept, though a chunk's padding repeats row 0
    for i, rows in ((1, (1, 2, 3)), (3, (4,))):
      for row in rows:
        ref_k, ref_v = window_fit(*(w[row][None] for w in windows[i]))  # windows [1, R, K, H]
        got = lambda c, side: oskvp.OSKVPParams(*(getattr(c, f"{n}_{side}")[row][None] for n in ("u", "scale", "cb")))
        _assert_params_close(got(cache, "k"), ref_k, tol=1e-4)
        _assert_params_close(got(cache, "v"), ref_v, tol=1e-4)
    runs[chunk] = (cache, jnp.stack(outs))
  for chunk in (1, 2):  # the same fits, up to rounding: bf16 windows within an ulp, codes but for edge cases
    assert_same_refits(runs[chunk][0], runs[8][0])
    np.testing.assert_allclose(runs[chunk][1], runs[8][1], rtol=1e-3, atol=1e-3)


def test_refit_chunk_must_be_positive():
  with pytest.raises(ValueError, match="refit_chunk=0"):
    OSKVPMode(refit_chunk=0)
