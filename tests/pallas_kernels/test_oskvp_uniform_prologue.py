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


def _rotating_inputs(seed, b, kh, g, dtype=jnp.bfloat16):
  """An unrotated query (bf16: the model's dtype; f32: its low part is not zero) and an orthogonal U_k per row and
  kv head, with `_prologue_inputs`' codebooks, scales and lengths."""
  q_rot, cb, scale, n_comp = _prologue_inputs(seed, b, kh, g)
  ks = jax.random.split(jax.random.key(seed + 100), 2)
  u_k = jnp.linalg.qr(jax.random.normal(ks[1], (b, kh, H, H)))[0]
  return (q_rot * 3.0).astype(dtype), u_k, cb, scale, n_comp


@pytest.mark.parametrize("g,dtype", [(1, jnp.bfloat16), (4, jnp.float32), (8, jnp.bfloat16), (8, jnp.float32)])
def test_rotating_prologue_matches_reference(g, dtype):
  """q' = q U_k inside the kernel (three bf16 dots of hi + lo parts) within 2e-5 of the f32 product at full precision
  (measured 2–6e-6 relative to the largest element); the four outputs are `prologue_reference` of the kernel's own q'
  to f32 rounding (digits exact; the f16 outlier query to one f16 step), and within one digit and 1e-3 of the
  reference through the f32 product."""
  args = _rotating_inputs(g, 2, 2, g, dtype)
  got = pro.rotating_prologue(*args, interpret=True)
  want = pro.rotating_prologue_reference(*args)
  for name, x, y in zip(("q_rot", "qd", "qs", "qo", "qc"), got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
  q_rot = np.asarray(got[0])
  scale = np.abs(np.asarray(want[0])).max()
  np.testing.assert_allclose(q_rot, np.asarray(want[0]), rtol=0, atol=2e-5 * scale)
  own = pro.prologue_reference(got[0], *args[2:])
  for name, x, y in zip(("qd", "qs", "qo", "qc"), got[1:], own, strict=True):
    rtol = 1e-3 if name == "qo" else 2e-6  # f16: the kernel's product order may round one step the other way
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=2e-6,
                               err_msg=name)
  assert np.abs(np.asarray(got[1], np.int32) - np.asarray(want[1], np.int32)).max() <= 1
  qs_scales = lambda qs: np.asarray(qs)[..., :dc.N]  # the per-head scales, not the length slot
  for name, x, y in (("qs", qs_scales(got[2]), qs_scales(want[2])), ("qo", got[3], want[3]), ("qc", got[4], want[4])):
    y = np.asarray(y, np.float32)
    np.testing.assert_allclose(np.asarray(x, np.float32), y, rtol=1e-3, atol=1e-4 * np.abs(y).max(), err_msg=name)


@pytest.mark.parametrize("g", [1, 8])
def test_rotating_prologue_lowers_to_triton_ir_for_hopper(g):
  assert lowers_to_triton_for_hopper(functools.partial(pro.rotating_prologue, interpret=False),
                                     *_rotating_inputs(0, 2, 2, g))


def test_rotating_prologue_refuses_other_head_dims():
  """U_k and its bf16 parts sit in a program's registers: H = 256 is refused by name (the plain prologue takes it)."""
  q, u_k, cb, scale, n_comp = _rotating_inputs(0, 1, 1, 4)
  wide = lambda x, axes: jnp.concatenate([x, x], axis=axes)
  with pytest.raises(ValueError, match="head_dim=256: rotating_prologue takes H=128"):
    pro.rotating_prologue(wide(q, -1), wide(wide(u_k, -1), -2), wide(cb, -2), scale, n_comp, interpret=True)
