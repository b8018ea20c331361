"""pallas_kernels/lloyd_max.py in interpret mode: one iteration against a numpy centroid step, many against the jnp
reference over awkward sample counts (1, a partial last block, several blocks), 2 / 4 / 8 levels and the uniform
form; zero-weight rows holding NaN and inf; vmap over heads; the Triton lowering for Hopper; errors naming inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hopper_lowering import lowers_to_triton_for_hopper

from pallas_kernels import lloyd_max as lm

GAUSS = {2: (-0.7979, 0.7979), 4: (-1.5104, -0.4528, 0.4528, 1.5104),
         8: (-2.152, -1.344, -0.756, -0.2451, 0.2451, 0.756, 1.344, 2.152)}


def _inputs(seed, n, h, n_levels, uniform=False, poison=True):
  """Laplace channels of varied scale and offset; ~20% zero weights, two of them on NaN / inf rows."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = np.asarray(jax.random.laplace(k1, (n, h))) * np.linspace(0.2, 4.0, h) + np.linspace(-3.0, 30.0, h)
  w = (np.asarray(jax.random.uniform(k2, (n,))) > 0.2).astype(np.float32)
  w[0] = 1.0
  if poison and n > 5:
    x[3], x[5], w[3], w[5] = np.nan, np.inf, 0.0, 0.0
  live = x[w > 0]
  g = 0.9957 * np.asarray(lm.UNIFORM_Z) if uniform else np.asarray(GAUSS[n_levels])
  init = live.mean(0)[:, None] + (live.std(0) + 0.1)[:, None] * g[None, :]
  return jnp.asarray(x, jnp.float32), jnp.asarray(w), jnp.asarray(init, jnp.float32), live.std(0) + 0.1


def _numpy_step(x, w, levels):
  """One Lloyd-Max centroid step in float64: each cell's weighted mean (nearest level, a tie to the lower one)."""
  x, w, levels = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(levels, np.float64)
  keep = w > 0
  x, w = x[keep], w[keep]
  thr = 0.5 * (levels[:, 1:] + levels[:, :-1])
  cell = np.sum(x[:, :, None] > thr[None], axis=-1)  # [N, H]
  out = levels.copy()
  for j in range(x.shape[1]):
    for c in range(levels.shape[1]):
      m = cell[:, j] == c
      if w[m].sum() > 0:
        out[j, c] = np.sum(w[m] * x[m, j]) / w[m].sum()
  return np.sort(out, axis=1)


@pytest.mark.parametrize("n,h,n_levels", [(1, 32, 4), (7, 32, 2), (130, 64, 8), (257, 32, 4)])
def test_one_iteration_is_the_centroid_step(n, h, n_levels):
  x, w, init, std = _inputs(n, n, h, n_levels)
  got = lm.lloyd_max(x, w, init, 1, interpret=True, block_n=64)
  np.testing.assert_allclose(got, _numpy_step(x, w, init), atol=2e-5 * std.max(), rtol=0)


def _channel_mse(x, w, levels):
  """Per-channel weighted mean squared error of nearest-level quantization, float64 [H]."""
  x, w, levels = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(levels, np.float64)
  keep = w > 0
  d = np.min((x[keep][:, :, None] - levels[None]) ** 2, axis=-1)
  return w[keep] @ d / w[keep].sum()


@pytest.mark.parametrize("n,h,n_levels,uniform", [(1, 32, 4, False), (7, 32, 2, False), (130, 64, 8, False),
                                                  (257, 32, 4, False), (1000, 128, 4, True), (63, 32, 4, True)])
def test_kernel_matches_reference(n, h, n_levels, uniform):
  """Four iterations: the same levels. Sixteen: the same error per channel to 1e-3 (a sample within rounding of a
  threshold can send the two down different paths of the not yet converged iterations: 4.5e-3 of a channel's
  spread apart after 16 uniform iterations on 1000 samples, errors 3e-4 apart, the kernel's the lower)."""
  x, w, init, std = _inputs(n + 100, n, h, n_levels, uniform)
  ref = lm.lloyd_max(x, w, init, 4, uniform=uniform, implementation="xla")
  got = lm.lloyd_max(x, w, init, 4, uniform=uniform, interpret=True, block_n=64)
  err = np.max(np.abs(np.asarray(got) - np.asarray(ref)) / std[:, None])
  assert err < 2e-5, err  # of each channel's spread
  ref = lm.lloyd_max(x, w, init, 16, uniform=uniform, implementation="xla")
  got = lm.lloyd_max(x, w, init, 16, uniform=uniform, interpret=True, block_n=64)
  assert bool(jnp.all(jnp.isfinite(got))) and got.shape == (h, n_levels)
  np.testing.assert_allclose(_channel_mse(x, w, got), _channel_mse(x, w, ref), rtol=1e-3, atol=1e-12)
  assert np.all(_channel_mse(x, w, got) <= _channel_mse(x, w, init) * (1 + 1e-6)), "no worse than the start"
  assert np.all(np.diff(np.asarray(got), axis=1) >= 0), "levels ascending"
  if uniform:  # equally spaced
    steps = np.diff(np.asarray(got), axis=1)
    np.testing.assert_allclose(steps, steps[:, :1].repeat(3, 1), rtol=1e-4)


def test_vmapped_heads_and_no_weight():
  """Heads batched by vmap (pallas_call's batching adds a grid axis) equal one call per head; a head with no weight
  keeps its starting levels."""
  xs, ws, inits = zip(*[_inputs(s, 200, 32, 4)[:3] for s in range(3)])
  x, w, init = jnp.stack(xs), jnp.stack(ws).at[2].set(0.0), jnp.stack(inits)
  got = jax.vmap(lambda a, b, c: lm.lloyd_max(a, b, c, 8, interpret=True))(x, w, init)
  for i in range(2):
    np.testing.assert_allclose(got[i], lm.lloyd_max(x[i], w[i], init[i], 8, interpret=True), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[2], init[2], rtol=1e-6, atol=1e-5)


def test_no_samples_keep_the_start():
  init = jnp.asarray(np.random.default_rng(0).normal(size=(32, 4)), jnp.float32)
  got = lm.lloyd_max(jnp.zeros((0, 32)), jnp.zeros((0,)), init, 4)
  np.testing.assert_allclose(got, np.sort(np.asarray(init), axis=1), rtol=1e-6)


def test_lowers_to_triton_under_vmap():
  x, w, init = jnp.zeros((3, 5, 1000, 128)), jnp.ones((3, 1000)), jnp.zeros((3, 5, 128, 4))
  per_head = lambda a, b, c: lm.lloyd_max(a, b, c, 16)
  assert lowers_to_triton_for_hopper(jax.vmap(jax.vmap(per_head, in_axes=(0, None, 0))), x, w, init)
  assert lowers_to_triton_for_hopper(lambda a, b, c: lm.lloyd_max(a, b, c, 4, uniform=True), x[0, 0], w[0],
                                     init[0, 0])


@pytest.mark.parametrize("args,match", [
    (dict(x=jnp.zeros((4, 2, 32))), "x must be"),
    (dict(w=jnp.ones((5,))), "w must be"),
    (dict(init=jnp.zeros((32, 3))), "init must be"),
    (dict(x=jnp.zeros((8, 48)), init=jnp.zeros((48, 4)), block_h=32), "block_h"),
    (dict(x=jnp.zeros((8, 32), jnp.int32)), "x must be floating"),
    (dict(uniform=True, init=jnp.zeros((32, 8))), "uniform"),
    (dict(implementation="cuda"), "implementation"),
    (dict(implementation="cuda", x=jnp.zeros((0, 32)), w=jnp.ones((0,))), "implementation"),  # before: ignored
    (dict(n_iters=-1), "n_iters=-1 must be an int >= 0"),  # before: the starting levels
    (dict(n_iters=2.5), "n_iters=2.5 must be an int >= 0"),  # before: a TypeError inside fori_loop
])
def test_bad_inputs_are_named(args, match):
  kw = dict(x=jnp.zeros((8, 32)), w=jnp.ones((8,)), init=jnp.zeros((32, 4)), n_iters=2) | args
  with pytest.raises(ValueError, match=match):
    lm.lloyd_max(kw.pop("x"), kw.pop("w"), kw.pop("init"), kw.pop("n_iters"), **kw)
