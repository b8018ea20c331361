"""moe_jax/kv_quant/lloyd.py: the sorted-sample Lloyd-Max against the one-pass-per-iteration reference of
`pallas_kernels/lloyd_max.py` and a float64 error, its binary search against numpy's, and the Pallas kernel behind
`fit_levels` / `OSKVPMode(fit_implementation=...)` (interpreted here) against the XLA path."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.kv_quant import OSKVPMode, lloyd, oskvp
from pallas_kernels import lloyd_max as lloyd_kernel


def _data(seed, n=300, h=16, n_levels=4, uniform=False):
  """Skewed channels with offsets; ~25% zero weights, one of them on a NaN row."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.gamma(k1, 2.0, (n, h)) * jnp.linspace(0.5, 3.0, h) + jax.random.normal(k3, (h,)) * 10
  w = (jax.random.uniform(k2, (n,)) > 0.25).astype(jnp.float32).at[0].set(1.0)
  x, w = x.at[4].set(jnp.nan), w.at[4].set(0.0)
  live = np.asarray(x)[np.asarray(w) > 0]
  g = 0.9957 * np.asarray(lloyd.UNIFORM_Z) if uniform else np.asarray(oskvp.GAUSSIAN_LEVELS[n_levels])
  init = live.mean(0)[:, None] + live.std(0)[:, None] * g[None, :]
  return x, w, jnp.asarray(init, jnp.float32), live.std(0)


def _mse(x, w, levels):
  """The weighted mean over samples and channels of the nearest-level squared error, in float64."""
  keep = np.asarray(w) > 0
  x, w, levels = np.asarray(x, np.float64)[keep], np.asarray(w, np.float64)[keep], np.asarray(levels, np.float64)
  return float(w @ np.min((x[:, :, None] - levels[None]) ** 2, axis=-1).mean(axis=1) / w.sum())


@pytest.mark.parametrize("n", [1, 5, 64, 1000])
def test_count_at_most_is_searchsorted_right(n):
  xs = np.sort(np.round(np.asarray(jax.random.normal(jax.random.PRNGKey(n), (3, n))), 1), axis=1)  # duplicates
  t = np.concatenate([xs[:, ::max(1, n // 7)], xs[:, :1] - 1, xs[:, -1:] + 1, xs[:, :1] + 0.05], axis=1)
  got = np.asarray(lloyd.count_at_most(jnp.asarray(xs), jnp.asarray(t)))
  want = np.stack([np.searchsorted(xs[i], t[i], side="right") for i in range(3)])
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n_levels", [2, 4, 8])
def test_sorted_lloyd_max_matches_the_per_sample_reference(n_levels):
  x, w, init, std = _data(n_levels, n_levels=n_levels)
  for iters in (1, 4):
    got, hist = lloyd.lloyd_max(x, w, init, iters)
    ref = lloyd_kernel.lloyd_max_reference(x, w, init, iters)
    assert np.max(np.abs(np.asarray(got - ref)) / std[:, None]) < 2e-5
    # The distortion history: before the first iteration and after the last, against float64 over the samples.
    np.testing.assert_allclose(hist[0], _mse(x, w, init), rtol=2e-5)
    np.testing.assert_allclose(hist[-1], _mse(x, w, got), rtol=2e-5)


def test_sorted_uniform_lloyd_matches_the_per_sample_reference():
  x, w, init, std = _data(7, uniform=True)
  centre, step = jnp.mean(init, axis=-1), init[:, 1] - init[:, 0]
  got, hist = lloyd.uniform_lloyd(x, w, centre, step, 4)
  ref = lloyd_kernel.lloyd_max_reference(x, w, init, 4, uniform=True)
  assert np.max(np.abs(np.asarray(got - ref)) / std[:, None]) < 2e-5
  np.testing.assert_allclose(hist[-1], _mse(x, w, got), rtol=2e-5)
  assert np.all(np.diff(np.asarray(hist)) <= 1e-6 * float(hist[0]))


def test_fit_levels_pallas_equals_xla_and_names_bad_implementation():
  x, w, init, std = _data(3, h=32)
  for uniform in (False, True):
    start = init if not uniform else _data(3, h=32, uniform=True)[2]
    a = lloyd.fit_levels(x, w, start, 4, uniform=uniform, implementation="xla")
    b = lloyd.fit_levels(x, w, start, 4, uniform=uniform, implementation="pallas")  # interpreted on the CPU
    assert np.max(np.abs(np.asarray(a - b)) / std[:, None]) < 2e-5
  with pytest.raises(ValueError, match="implementation"):
    lloyd.fit_levels(x, w, init, 4, implementation="triton")


@pytest.mark.parametrize("kw", [{}, {"uniform": True}, {"symmetric": True}])
def test_mode_fits_the_same_codebooks_with_the_kernel(kw):
  """A prefill fit of keys (RoPE-shifted copies) and values with the Lloyd iterations in the (interpreted) kernel
  gives the XLA path's bases and codebooks; ragged lengths, one row shorter than H (the fallback, no Lloyd)."""
  k, v = jax.random.normal(jax.random.PRNGKey(5), (2, 2, 80, 2, 32))
  lengths = jnp.array([80, 20])
  fits = [OSKVPMode(window=16, fit_implementation=impl, **kw).fit_keys_values(k, v, lengths, rope_span=256)
          for impl in ("xla", "pallas")]
  for a, b in zip(*fits):
    np.testing.assert_allclose(a.u, b.u, atol=1e-6)
    np.testing.assert_allclose(a.codebook, b.codebook, atol=1e-4)
    np.testing.assert_allclose(a.scale, b.scale, rtol=1e-5)


@pytest.mark.parametrize("impl,backend,kernel", [("pallas", "cpu", True), ("xla", "gpu", False), ("auto", "cpu", False),
                                                 ("auto", "gpu", True)])
def test_fit_implementation_picks_the_kernel(impl, backend, kernel):
  """Whether the fit's program holds the Pallas kernel: "auto" takes it on the GPU only (backend patched; traced,
  not run)."""
  k = jnp.zeros((1, 40, 1, 32))
  mode = OSKVPMode(window=16, fit_implementation=impl)
  with mock.patch.object(jax, "default_backend", lambda: backend):
    text = str(jax.make_jaxpr(lambda k: mode.fit_keys_values(k, k, jnp.array([40]), rope_span=64))(k))
  assert ("pallas_call" in text) == kernel


def test_a_trace_for_the_gpu_leaves_no_kernel_for_the_cpu():
  """A fit traced with the backend patched to "gpu" (the kernel, not interpreted) must not be what a later real call
  on the CPU gets from `oskvp.fit`'s jit cache: OSKVPMode decides `lloyd_interpret` before that jit, in its key.
  (Before, the real call failed: "Only interpret mode is supported on CPU backend".)"""
  k = jax.random.normal(jax.random.PRNGKey(4), (1, 44, 1, 32))
  fit = lambda impl: OSKVPMode(window=16, fit_implementation=impl).fit_keys_values(k, k, jnp.array([44]),
                                                                                   rope_span=64)
  with mock.patch.object(jax, "default_backend", lambda: "gpu"):
    jax.make_jaxpr(lambda: fit("auto"))()
  for a, b in zip(fit("pallas"), fit("xla")):
    np.testing.assert_allclose(a.codebook, b.codebook, atol=1e-4)


@pytest.mark.parametrize("heads,n,backend,want", [(8, 4096, "gpu", "xla"), (64, 4096, "gpu", "pallas"),
                                                   (8, 1024, "gpu", "pallas"), (384, 1024, "cpu", "xla")])
def test_auto_takes_the_kernel_unless_few_heads_have_many_samples(heads, n, backend, want):
  with mock.patch.object(jax, "default_backend", lambda: backend):
    assert lloyd.auto_implementation(heads, n, 128) == want


def test_mode_names_a_bad_fit_implementation():
  with pytest.raises(ValueError, match="fit_implementation"):
    OSKVPMode(fit_implementation="cuda")


def test_one_cell_keeps_its_step_and_bad_weights_leave_rows_out():
  """A channel whose samples all fall in one cell (3 ± 0.03, between thresholds 2.7 and 3.7) keeps its step, with
  fractional weights, whose running sums do not add up to the total exactly; negative and NaN weights act as 0,
  like dropping the rows."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(11))
  x = 3.0 + 0.01 * jax.random.normal(k1, (4096, 8))
  w = jax.random.uniform(k2, (4096,), minval=0.1, maxval=1.0)
  step = jnp.ones((8,))
  for impl in ("xla", "pallas"):
    levels = lloyd.fit_levels(x, w, 3.7 + step[:, None] * jnp.asarray(lloyd.UNIFORM_Z), 4, uniform=True,
                              implementation=impl)
    np.testing.assert_allclose(np.diff(np.asarray(levels), axis=1), 1.0, rtol=1e-5)
  x, w, init, _ = _data(12)
  bad = w.at[10:20].set(-1.0).at[20].set(jnp.nan)
  keep = np.asarray(w) > 0
  keep[10:21] = False
  want, _ = lloyd.lloyd_max(x[keep], w[keep], init, 4)
  got, _ = lloyd.lloyd_max(x, bad, init, 4)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
