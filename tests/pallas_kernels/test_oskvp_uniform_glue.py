"""The two Pallas (Triton) kernels around the fused Mosaic GPU core: interpret mode against their jnp references,
and their lowering to Triton IR for an H100-class GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_uniform_glue as gl
from pallas_kernels.oskvp_random import uniform_codebooks

H, R = 128, 128


def _prologue_inputs(seed, b, kh, g):
  ks = jax.random.split(jax.random.key(seed), 4)
  q_rot = jax.random.normal(ks[0], (b, kh, g, H))
  cb = uniform_codebooks(ks[2], (b, kh, H), outliers=8)
  scale = jax.random.uniform(ks[3], (b, kh, 8), minval=0.01, maxval=0.1)
  return q_rot, cb, scale, jnp.arange(b, dtype=jnp.int32) * 1000 + 5


@pytest.mark.parametrize("g", [1, 4, 8])
def test_prologue_matches_reference(g):
  """Digits exact (a rounding tie could differ: half away from zero vs half to even; none here), scales, the
  key-outlier query and the constant to f32 rounding; padding rows zero; the length in slot 8."""
  args = _prologue_inputs(g, 2, 2, g)
  got = gl.prologue(*args, interpret=True)
  want = gl.prologue_reference(*args)
  names = ("qd", "qs", "qo", "qc")
  for name, x, y in zip(names, got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-6, atol=2e-6,
                               err_msg=name)
  qd, qs = np.asarray(got[0]), np.asarray(got[1])
  assert (qd[:, :, g:] == 0).all() and np.abs(qd[:, :, :g]).max() == 127
  np.testing.assert_array_equal(qs[:, :, dc.N], np.repeat(np.asarray(args[3], np.float32)[:, None], 2, 1))


def _epilogue_inputs(seed, b, kh, splits, g=4, empty_split=True):
  ks = jax.random.split(jax.random.key(seed), 8)
  acc = jax.random.uniform(ks[0], (b, kh, splits, H, 8)) * 3000.0
  m = jax.random.normal(ks[1], (b, kh, splits, 8)) * 4
  if empty_split:
    m = m.at[:, :, 0].set(dc.MASKED)  # a split that saw no token: l = 0
  l = jnp.where(m > 0.5 * dc.MASKED, jax.random.uniform(ks[2], m.shape, minval=1.0, maxval=1000.0), 0.0)
  ml = jnp.concatenate([m, l, jnp.zeros((b, kh, splits, 16))], axis=-1)
  acco = jax.random.normal(ks[3], (b, kh, splits, 8, 8)) * 100.0
  q_rot = jax.random.normal(ks[4], (b, kh, g, H))
  qc = jax.random.normal(ks[5], (b, kh, 8))
  c0 = jax.random.normal(ks[6], (b, kh, H))
  cb = c0[..., None] + 0.5 * jnp.arange(4.0)
  res = jax.random.normal(ks[7], (2, b, kh, R, H)).astype(jnp.bfloat16)
  n_res = jnp.array([0, 77, 128][:b], jnp.int32)
  return acc, ml, acco, q_rot, qc, cb, jnp.full((b, kh, 8), 0.05), res[0], res[1], n_res


@pytest.mark.parametrize("splits,g", [(4, 4), (64, 8), (16, 1)])
def test_epilogue_matches_reference(splits, g):
  """Split merge (4 to 64 splits: 32 and 16 output channels per program), the value outliers on channels 0..7 only,
  the window (empty, partial, full) and the log-sum-exp merge: equal to the f32 jnp reference to 1e-5 relative
  (the window's dots as bf16 hi + lo parts) on the G live rows; a row with no compressed token at all gives the
  window's attention exactly."""
  args = list(_epilogue_inputs(3, 3, 2, splits, g))
  got = np.asarray(gl.epilogue(*args, interpret=True))[:, :, :g]
  want = np.asarray(gl.epilogue_reference(*args))[:, :, :g]
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  args[1] = args[1].at[1, 0, :, :8].set(dc.MASKED).at[1, 0, :, 8:16].set(0.0)  # row (1, 0): no compressed token
  got = np.asarray(gl.epilogue(*args, interpret=True))[1, 0, :g]
  qr, res_k, res_v = (np.asarray(a[1, 0], np.float32) for a in (args[3], args[7], args[8]))
  s = qr @ res_k[:77].T * H**-0.5
  p = np.exp(s - s.max(axis=1, keepdims=True))
  want = (p / p.sum(axis=1, keepdims=True)) @ res_v[:77]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_epilogue_refuses_tiles_triton_cannot_hold():
  args = list(_epilogue_inputs(0, 1, 1, 4))
  with pytest.raises(ValueError, match="window R=96"):
    gl.epilogue(*args[:7], args[7][:, :, :96], args[8][:, :, :96], args[9], interpret=True)


def test_glue_lowers_to_triton_ir_for_hopper():
  """Both kernels lower to Triton IR for an H100-class GPU on the CPU (`hopper_lowering.py`)."""
  for fn, args in ((gl.prologue, _prologue_inputs(0, 2, 2, 4)), (gl.epilogue, _epilogue_inputs(0, 2, 2, 16)),
                   (gl.epilogue, _epilogue_inputs(0, 1, 8, 64, g=8))):
    assert lowers_to_triton_for_hopper(functools.partial(fn, interpret=False), *args)


def test_acc_row_channel_matches_the_value_side_order():
  from pallas_kernels import oskvp_value_sums_mgpu as vs  # pylint: disable=g-import-not-at-top
  for q in (32, 64):
    got = [rg.acc_row_channel(rg.Ints, r, q) for r in range(4 * q)]
    np.testing.assert_array_equal(got, vs.acc_row_channels(q))
