"""The Pallas (Triton) prologue of the wired OS-KVP path: interpret mode against its jnp reference, and its lowering
to Triton IR for an H100-class GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_uniform_prologue as pro
from pallas_kernels.oskvp_random import uniform_codebooks

H = 128


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
  got = pro.prologue(*args, interpret=True)
  want = pro.prologue_reference(*args)
  names = ("qd", "qs", "qo", "qc")
  for name, x, y in zip(names, got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-6, atol=2e-6,
                               err_msg=name)
  qd, qs = np.asarray(got[0]), np.asarray(got[1])
  assert (qd[:, :, g:] == 0).all() and np.abs(qd[:, :, :g]).max() == 127
  np.testing.assert_array_equal(qs[:, :, dc.N], np.repeat(np.asarray(args[3], np.float32)[:, None], 2, 1))


@pytest.mark.parametrize("g", [1, 4, 8])
def test_prologue_lowers_to_triton_ir_for_hopper(g):
  assert lowers_to_triton_for_hopper(functools.partial(pro.prologue, interpret=False), *_prologue_inputs(0, 2, 2, g))
