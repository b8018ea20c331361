"""Mosaic GPU int4 grouped matmul (Mosaic GPU interpret mode on CPU) vs the XLA reference over awkward group sizes.

The interpreter leaves unwritten memory NaN, so a row the kernel forgets to store fails the comparison; rows past
sum(group_sizes) must come back zero, as from `jax.lax.ragged_dot`. The interpreter takes the wgmma A operand from
shared memory and runs no inline PTX, so the GPU-only pieces (registers reinterpreted as wgmma fragments, the PTX
dequant) are checked here only as far as lowering them to a Mosaic GPU kernel; `benchmarks/int4_mgpu_decode.py`
checks their values on the H200.
"""

import jax
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np
import pytest

from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import int4_grouped_matmul_mgpu as mg

E, K, N, G = 4, 256, 64, 128


def _weights(key):
  ks = jax.random.split(key, 3)
  return i4.Int4Weights(
      packed=jax.random.bits(ks[0], (E, K // 2, N), jnp.uint8),
      scale=jax.random.uniform(ks[1], (E, K // G, N), jnp.float32, 0.01, 0.1).astype(jnp.bfloat16),
      zero=jax.random.randint(ks[2], (E, K // G, N), 0, 16).astype(jnp.uint8))


def _inputs(sizes, extra):
  m = sum(sizes) + extra
  x = jax.random.normal(jax.random.key(7 * m + len(sizes)), (m, K), jnp.bfloat16)
  return x, jnp.asarray(sizes, jnp.int32), _weights(jax.random.key(m))


# (group sizes, rows owned by no expert): empty experts, one row, all rows in one expert, M not a multiple of 8 or of
# the row tile, more rows per expert than one tile, trailing rows, no rows at all in experts.
CASES = [([3, 0, 17, 1], 0), ([0, 0, 21, 0], 3), ([1, 1, 1, 1], 0), ([0, 0, 0, 0], 2)]


@pytest.mark.parametrize("sizes,extra", CASES)
@pytest.mark.parametrize("cfg", [dict(), dict(block_r=16, block_k=128, max_concurrent_steps=2)])
def test_matches_reference(sizes, extra, cfg):
  x, gs, ws = _inputs(sizes, extra)
  got = np.asarray(mg.int4_grouped_matmul_mgpu(x, mg.to_mgpu_layout(ws), gs, interpret=True, **cfg))
  want = np.asarray(i4.int4_grouped_matmul_reference(x, ws, gs))
  # Same bf16 weights as the reference, float32 accumulation in another order.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
  assert not np.any(got[sum(sizes):])  # rows of no expert are zero


def _cut(sizes, m):
  """group_sizes as the kernels take them: a negative size counts as 0, the rows stop at M."""
  return jnp.asarray(np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0))]), m)), jnp.int32)


@pytest.mark.parametrize("sizes,m", [([3, -2, 4, 1], 8), ([5, 0, 9, 4], 12), ([20, 20, 0, 0], 24)])
def test_negative_sizes_and_sizes_past_m_stay_in_bounds(sizes, m):
  """group_sizes cannot be checked under jit. Sizes summing past M made tiles store past the output (an
  out-of-bounds copy in the interpreter); now they count from 0 and stop at M, as the Triton kernels' offsets."""
  x = jax.random.normal(jax.random.key(m), (m, K), jnp.bfloat16)
  ws = _weights(jax.random.key(m + 1))
  got = np.asarray(mg.int4_grouped_matmul_mgpu(x, mg.to_mgpu_layout(ws), jnp.asarray(sizes, jnp.int32), interpret=True))
  want = np.asarray(i4.int4_grouped_matmul_reference(x, ws, _cut(sizes, m)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))


def test_group_sizes_of_another_length_or_dtype_are_refused():
  """Before: [2, 3] for 4 experts streamed expert 2's weights into the rows past the groups; floats were truncated."""
  x, _, ws = _inputs([3, 0, 17, 1], 0)
  for gs in (jnp.asarray([2, 3], jnp.int32), jnp.asarray([3.0, 0, 17, 1], jnp.float32)):
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(4,\)"):
      mg.int4_grouped_matmul_mgpu(x, mg.to_mgpu_layout(ws), gs, interpret=True)


def test_no_races_in_the_interpreter():
  """The interpreter's happens-before race detector sees no race between TMA, barriers, wgmma and the stores.

  (Its wgmma is synchronous, so it cannot see a wgmma still reading registers; that one is covered on the GPU.)
  """
  x, gs, ws = _inputs([3, 0, 17, 1], 2)
  params = plgpu.InterpretGPUParams(detect_races=True)
  got = mg.int4_grouped_matmul_mgpu(x, mg.to_mgpu_layout(ws), gs, interpret=params, max_concurrent_steps=2)
  assert not interpret_pallas_call.get_races().races_found
  want = i4.int4_grouped_matmul_reference(x, ws, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_layout_keeps_the_weight():
  """to_mgpu_layout (signed codes, zero point - 8, K_ORDER) dequantizes to exactly the quantizer's bf16 weight."""
  x, gs, ws = _inputs([5, 0, 2, 9], 0)
  w = mg.to_mgpu_layout(ws)
  assert w.q.dtype == jnp.int4 and w.q.shape == (E, N, K)
  np.testing.assert_array_equal(np.asarray(mg.int4_grouped_matmul_mgpu_reference(x, w, gs)),
                                np.asarray(i4.int4_grouped_matmul_reference(x, ws, gs)))
  # The uint16 kernel layout of the Triton kernel converts to the same thing.
  w_nk = mg.to_mgpu_layout(i4.to_nk_layout(ws))
  np.testing.assert_array_equal(np.asarray(w_nk.q.astype(jnp.int8)), np.asarray(w.q.astype(jnp.int8)))
  assert sorted(mg.K_ORDER.tolist()) == list(range(32))


@pytest.mark.parametrize("sizes,m,block_r", [([3, 0, 17, 1], 21, 8), ([0, 0, 40, 0], 45, 16), ([1] * 6, 6, 8)])
def test_row_tiles_cover_each_row_once(sizes, m, block_r):
  m_loaded = max(m + (-m % 8), block_r + 8)
  tiles = np.asarray(mg.row_tiles(jnp.asarray(sizes, jnp.int32), m, block_r, m_loaded))
  owner = np.repeat(np.arange(len(sizes) + 1), sizes + [m - sum(sizes)])  # virtual expert E past the groups
  seen = np.zeros(m, np.int32)
  for expert, first, count, loaded in tiles[tiles[:, 2] > 0]:
    rows = np.arange(first, first + count)
    seen[rows] += 1
    assert np.all(owner[rows] == expert) and count <= block_r
    assert loaded % 8 == 0 and loaded <= first and first + count <= loaded + block_r + 8 <= m_loaded
  np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("dequant", mg.DEQUANTS)
def test_gpu_path_lowers(dequant):
  """The GPU-only path (fragment reinterpretation, PTX dequant, wgmma from registers) lowers to a Mosaic kernel."""
  x, gs, ws = _inputs([3, 0, 17, 1], 0)
  f = jax.jit(lambda a, w, g: mg.int4_grouped_matmul_mgpu(a, w, g, dequant=dequant))
  text = f.trace(x, mg.to_mgpu_layout(ws), gs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_rejects_bad_arguments():
  x, gs, ws = _inputs([1, 2, 3, 4], 0)
  w = mg.to_mgpu_layout(ws)
  with pytest.raises(TypeError, match="bfloat16"):
    mg.int4_grouped_matmul_mgpu(x.astype(jnp.float32), w, gs, interpret=True)
  with pytest.raises(ValueError, match="block_n"):
    mg.int4_grouped_matmul_mgpu(x, w, gs, block_n=96, interpret=True)
  with pytest.raises(ValueError, match="pad lhs"):
    mg.int4_grouped_matmul_mgpu(x[:, :128], w, gs, interpret=True)
  with pytest.raises(ValueError, match="dequant"):
    mg.int4_grouped_matmul_mgpu(x, w, gs, dequant="lut", interpret=True)
