"""The Pallas (Triton) epilogue of the wired OS-KVP path: interpret mode against its jnp reference, and its lowering
to Triton IR for an H100-class GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_uniform_epilogue as epi
from pallas_kernels import oskvp_value_sums_mgpu as vs
from pallas_kernels.oskvp_random import random_epilogue_inputs

H, R = 128, 128


def _inputs(seed, b, kh, splits, g=4, empty_split=True, h=H):
  """`random_epilogue_inputs` with windows of 0, 77 and 128 tokens (rows 0, 1, 2): `rotating_epilogue`'s arguments."""
  return random_epilogue_inputs(jax.random.key(seed), jnp.array([0, 77, 128][:b]), batch=b, kv_heads=kh,
                                splits=splits, group=g, head_dim=h, window=R, empty_split=empty_split)


def _epilogue_inputs(*a, **kw):
  """`_inputs` less U_v: `epilogue`'s arguments."""
  return _inputs(*a, **kw)[:-1]


@pytest.mark.parametrize("splits,g", [(1, 4), (2, 8), (4, 4), (64, 8), (16, 1), (128, 4)])
def test_epilogue_matches_reference(splits, g):
  """Split merge (1 to 128 splits: 32 and 16 output channels per program; 1 and 2 are the mma core's at batch 64 and
  32, `wired_tiling`), the value outliers on channels 0..7 only,
  the window (empty, partial, full) and the log-sum-exp merge: equal to the f32 jnp reference to 1e-5 relative
  (the window's dots as bf16 hi + lo parts) on the G live rows; a row with no compressed token at all gives the
  window's attention exactly."""
  args = list(_epilogue_inputs(3, 3, 2, splits, g, empty_split=splits > 1))  # (one split: it holds tokens)
  got = np.asarray(epi.epilogue(*args, interpret=True))
  want = np.asarray(epi.epilogue_reference(*args))
  assert got.shape == want.shape == (3, 2, g, H)  # the live rows only: no slice after the kernel
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  args[1] = args[1].at[1, 0, :, :8].set(dc.MASKED).at[1, 0, :, 8:16].set(0.0)  # row (1, 0): no compressed token
  got = np.asarray(epi.epilogue(*args, interpret=True))[1, 0]
  qr, res_k, res_v = (np.asarray(a[1, 0], np.float32) for a in (args[3], args[7], args[8]))
  s = qr @ res_k[:77].T * H**-0.5
  p = np.exp(s - s.max(axis=1, keepdims=True))
  want = (p / p.sum(axis=1, keepdims=True)) @ res_v[:77]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("splits,g,h,hc", [(2, 4, 128, 128), (1, 4, 128, 64), (8, 8, 128, 64), (4, 1, 256, 128),
                                           (64, 4, 128, 128)])
def test_wide_epilogue_matches_reference(splits, g, h, hc):
  """Programs of 64 to 128 output channels (the window scored once for 2 to 4 runs of 32, each stored by itself;
  a whole head at H = 128, half of one at H = 256): equal to the f32 jnp reference to 1e-5 relative, as the 32-channel
  programs are, on all B × K × G × H outputs (a run left unwritten would fail it: the output is not zeroed)."""
  args = _epilogue_inputs(5, 3, 2, splits, g, empty_split=splits > 1, h=h)
  got = np.asarray(epi.epilogue(*args, channels=hc, interpret=True))
  want = np.asarray(epi.epilogue_reference(*args))
  assert got.shape == want.shape == (3, 2, g, h) and np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_epilogue_channels_widen_while_256_programs_stay_in_flight():
  """The default width per program: 32 at batch 1 and 8 (× 8 kv heads), 64 at 16, 128 from 32 (as measured fastest
  on an H100 at each); never above 128 or H, never dividing H unevenly; 16 above 64 splits whatever the rows."""
  assert [epi.epilogue_channels(8, 8 * b) for b in (1, 8, 16, 32, 64, 312)] == [32, 32, 64, 128, 128, 128]
  assert epi.epilogue_channels(2, 256, head_dim=256) == 128  # two programs a row: 512 in flight
  assert epi.epilogue_channels(2, 4096, head_dim=256) == 128  # capped
  assert epi.epilogue_channels(2, 64, head_dim=256) == 64
  assert epi.epilogue_channels(128, 4096) == 16
  assert epi.epilogue_channels(64, 4096) == 128
  for rows in (1, 64, 128, 256):  # every default width is one the epilogue takes
    assert epi.epilogue_shape_error(128, 4, 128, epi.epilogue_channels(4, rows)) is None


@pytest.mark.parametrize("splits,g,h,cols", [(4, 4, 128, None), (64, 8, 128, None), (16, 1, 128, 32),
                                             (8, 4, 256, 64)])
def test_rotating_epilogue_matches_reference(splits, g, h, cols):
  """The merge of all H channels (4 or 8 runs of 32) and U_vᵀ in one program per row and kv head: equal to
  `epilogue_reference` rotated in f32 to 1e-5 of the largest element (the rotation's dots as bf16 hi + lo parts,
  ~2^-16; measured ~5e-6); written in bf16 it is that within a bf16 rounding."""
  args = _inputs(3, 3, 2, splits, g, True, h)
  want = np.asarray(epi.rotating_epilogue_reference(*args))
  got = np.asarray(epi.rotating_epilogue(*args, interpret=True))
  assert got.shape == want.shape == (3, 2, g, h) and np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  got16 = epi.rotating_epilogue(*args, interpret=True, out_dtype=jnp.bfloat16, out_channels=cols)
  assert got16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got16, np.float32), want, rtol=2**-8, atol=1e-5 * np.abs(want).max())


def test_rotating_epilogue_refuses_what_one_program_cannot_hold():
  args = _inputs(0, 1, 1, 128)
  with pytest.raises(ValueError, match="splits=128: the rotating epilogue takes at most 64"):
    epi.rotating_epilogue(*args, interpret=True)
  with pytest.raises(ValueError, match="out_channels=48 must be a power of two"):
    epi.rotating_epilogue(*_inputs(0, 1, 1, 16), interpret=True, out_channels=48)
  assert "window R=96" in epi.rotating_epilogue_shape_error(96, 16, 128)
  assert epi.rotating_epilogue_shape_error(128, 64, 128, group=8) is None
  # H = 384 passed the check and failed in the kernel over out_channels, an argument the caller never passed
  assert "head_dim=384: the rotating epilogue takes a power of two" in epi.rotating_epilogue_shape_error(128, 4, 384)


@pytest.mark.parametrize("h,hc", [(128, 32), (128, 16), (256, 32), (256, 16)])
def test_acc_view_blocks_are_the_channel_runs(h, hc):
  """Program c's block of `acc_view` over the core's ACC row order holds channels [c·hc, (c + 1)·hc) in order."""
  acc = jnp.asarray(vs.acc_row_channels(h // 4), jnp.float32)[:, None] * jnp.ones((1, 8))  # row -> its channel
  view, block, index = epi.acc_view(acc, hc)
  for c in range(h // hc):
    sl = tuple(i if n is None else slice(i * n, (i + 1) * n) for n, i in zip(block, index(c)))  # None: squeezed
    got = np.asarray(view[sl]).reshape(hc, 8)
    np.testing.assert_array_equal(got[:, 0], np.arange(c * hc, (c + 1) * hc))


def test_epilogue_refuses_tiles_triton_cannot_hold():
  args = list(_epilogue_inputs(0, 1, 1, 4))
  with pytest.raises(ValueError, match="window R=96"):
    epi.epilogue(*args[:7], args[7][:, :, :96], args[8][:, :, :96], args[9], interpret=True)
  with pytest.raises(ValueError, match="channels=48 must be 16, 32 or a power-of-two multiple of 32"):
    epi.epilogue(*args, channels=48, interpret=True)
  with pytest.raises(ValueError, match="channels=256 must be"):  # wider than the head
    epi.epilogue(*args, channels=256, interpret=True)
  for bad in (0, -64):
    assert f"channels={bad} must be" in epi.epilogue_shape_error(128, 4, 128, channels=bad)
  assert "channels=64 with splits=128" in epi.epilogue_shape_error(128, 128, 128, channels=64)
  assert epi.epilogue_shape_error(128, 128, 128, channels=32) is None
  assert "head_dim=96" in epi.epilogue_shape_error(128, 16, 96)  # acc_view reads runs of 128 channels
  assert "G=3" in epi.epilogue_shape_error(128, 16, 128, group=3)  # live_rows' row groups divide 8
  assert epi.epilogue_shape_error(128, 16, 128, group=4) is None


def test_epilogue_lowers_to_triton_ir_for_hopper():
  """16 splits (32 channels per program) at G = 4 and 1, 64 splits at G = 8 (32), 128 splits (16); 2 splits with
  128 channels per program and 8 with 64."""
  for args, hc in ((_epilogue_inputs(0, 2, 2, 16), None), (_epilogue_inputs(0, 2, 2, 16, g=1), None),
                   (_epilogue_inputs(0, 1, 8, 64, g=8), None), (_epilogue_inputs(0, 1, 1, 128), None),
                   (_epilogue_inputs(0, 2, 2, 2), 128), (_epilogue_inputs(0, 2, 2, 8), 64)):
    assert lowers_to_triton_for_hopper(functools.partial(epi.epilogue, interpret=False, channels=hc), *args)


def test_rotating_epilogue_lowers_to_triton_ir_for_hopper():
  """16 splits at G = 4 (bf16 output; all channels, and 32 per program) and at G = 1 (bf16); batch 1 × 64 splits at
  G = 8 (f32)."""
  for args, dtype, cols in ((_inputs(0, 2, 2, 16), jnp.bfloat16, None), (_inputs(0, 2, 2, 16), jnp.bfloat16, 32),
                            (_inputs(0, 2, 2, 16, g=1), jnp.bfloat16, None),
                            (_inputs(0, 1, 8, 64, g=8), jnp.float32, None)):
    assert lowers_to_triton_for_hopper(functools.partial(epi.rotating_epilogue, interpret=False, out_dtype=dtype,
                                                         out_channels=cols), *args)
