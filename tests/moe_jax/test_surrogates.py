"""Low-rank expert surrogates: SVD optimality, whitening, the grouped-matmul call, memory accounting."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import surrogates

@jax.jit
def _residual_norm(w, a, b):
  return jnp.linalg.norm(w - a @ b)


@jax.jit
def _whitening_inputs():
  """Anisotropic inputs x, a weight w and the inputs' second moment (one program)."""
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  d, n = 32, 2048
  mix = jax.random.normal(k1, (d, d)) * jnp.logspace(0, -2, d)[None, :]  # strongly anisotropic inputs
  x = jax.random.normal(k2, (n, d)) @ mix.T
  w = jax.random.normal(k3, (d, 48))
  return x, w, x.T @ x / n


@jax.jit
def _output_error(x, w, a, b):
  return jnp.linalg.norm(x @ w - (x @ a) @ b)


@functools.partial(jax.jit, static_argnums=2)
def _loop_reference(sur, x, group_sizes):
  """Slow loop-over-experts reference (group sizes static)."""
  rows, start = [], 0
  for ei, g in enumerate(group_sizes):
    xe = x[start:start + g]
    h = jax.nn.silu(xe @ sur.gate_a[...][ei] @ sur.gate_b[...][ei]) * (xe @ sur.up_a[...][ei] @ sur.up_b[...][ei])
    rows.append(h @ sur.down_a[...][ei] @ sur.down_b[...][ei])
    start += g
  return jnp.concatenate(rows)


def test_plain_low_rank_is_the_truncated_svd():
  w = jax.random.normal(jax.random.key(0), (24, 40))
  s = np.linalg.svd(np.asarray(w), compute_uv=False)
  for r in (1, 5, 24):
    a, b = surrogates.low_rank(w, r)
    assert a.shape == (24, r) and b.shape == (r, 40)
    err = float(_residual_norm(w, a, b))
    assert err == pytest.approx(float(np.sqrt(np.sum(s[r:] ** 2))), abs=1e-4)  # Eckart-Young


def test_whitening_lowers_the_output_error_on_calibration_like_inputs():
  d, r = 32, 6
  x, w, c = _whitening_inputs()
  plain = surrogates.low_rank(w, r)
  white = surrogates.low_rank(w, r, c)
  err = lambda ab: float(_output_error(x, w, *ab))
  assert err(white) < 0.7 * err(plain)
  full = surrogates.low_rank(w, d, c)  # full rank: exact whatever the whitening
  np.testing.assert_allclose(*jax.jit(lambda x, w, a, b: (x @ a @ b, x @ w))(x, w, *full), rtol=1e-3, atol=1e-3)


def test_low_rank_experts_follow_the_expert_fn_contract(tiny_model):
  moe = tiny_model.blocks[0].ffn
  e, d, f = moe.w_gate[...].shape
  calib = jax.random.normal(jax.random.key(2), (256, d))
  sur = surrogates.LowRankExperts(moe.w_gate[...], moe.w_up[...], moe.w_down[...], rank=5, calibration=calib)
  group_sizes = jnp.array([2, 0, 2, 2, 0, 2, 2, 2], jnp.int32)  # equal sizes: the eager loop compiles once
  x = jax.random.normal(jax.random.key(3), (int(group_sizes.sum()), d))
  got = jax.jit(lambda s, x, g: s(x, g))(sur, x, group_sizes)
  np.testing.assert_allclose(got, _loop_reference(sur, x, tuple(np.asarray(group_sizes).tolist())), rtol=1e-5,
                             atol=1e-5)
  full = surrogates.LowRankExperts(moe.w_gate[...], moe.w_up[...], moe.w_down[...], rank=min(d, f))
  both = jax.jit(lambda s, m, x, g: (s(x, g), m.expert_fn(x, g)))(full, moe, x, group_sizes)
  np.testing.assert_allclose(*both, rtol=1e-4, atol=1e-4)


def test_memory_accounting_and_budget(tiny_config):
  c = tiny_config
  per_layer = surrogates.nbytes_per_layer(c.n_experts, c.d_model, c.expert_hidden, 8, 4)
  w = jnp.zeros((c.n_experts, c.d_model, c.expert_hidden))
  sur = surrogates.LowRankExperts(w + 1.0, w + 1.0, jnp.swapaxes(w, 1, 2) + 1.0, rank=8)
  assert sur.nbytes() == per_layer
  r = surrogates.rank_for_budget(c.n_experts, c.d_model, c.expert_hidden, 2, budget_bytes=2 * per_layer,
                                 bytes_per_element=4)
  assert r == 8
  with pytest.raises(ValueError, match="budget_bytes"):
    surrogates.rank_for_budget(c.n_experts, c.d_model, c.expert_hidden, 2, budget_bytes=10)
  with pytest.raises(ValueError, match="rank=0"):
    surrogates.LowRankExperts(w, w, jnp.swapaxes(w, 1, 2), rank=0)


def test_bad_calibration_is_named_not_turned_into_nan_factors(tiny_model):
  """Before, an empty calibration (0/0 second moments) or one id past the vocabulary (a NaN embedding) gave NaN
  factors in every layer, and NaN logits wherever a surrogate served, with no error."""
  moe = next(b.ffn for b in tiny_model.blocks if hasattr(b.ffn, "w_gate"))
  w = (moe.w_gate[...], moe.w_up[...], moe.w_down[...])
  d = w[0].shape[1]
  with pytest.raises(ValueError, match=rf"calibration must be \[n >= 1, D={d}\] layer inputs, got shape \(0, {d}\)"):
    surrogates.LowRankExperts(*w, rank=4, calibration=jnp.zeros((0, d)))
  with pytest.raises(ValueError, match="calibration holds non-finite values"):
    surrogates.LowRankExperts(*w, rank=4, calibration=jnp.full((3, d), jnp.nan))
  vocab = tiny_model.config.vocab_size
  bad = np.zeros((2, 8), np.int32)
  bad[0, 5] = vocab
  with pytest.raises(ValueError, match=rf"token id {vocab} at tokens\[0, 5\] is outside the vocabulary"):
    surrogates.build_surrogates(tiny_model, 4, bad)
  with pytest.raises(ValueError, match=r"calibration_tokens must be a non-empty int \[B, T\] array"):
    surrogates.build_surrogates(tiny_model, 4, np.zeros((2, 0), np.int32))
