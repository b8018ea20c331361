"""int4 dequant-fused grouped matmul (interpret mode) vs its XLA reference over awkward group sizes.

Outputs start poisoned with NaN, so a row the kernel forgets to write fails the comparison; rows past
sum(group_sizes) must come back zero, as from `jax.lax.ragged_dot`. Both weight layouts run: uint8 (x @ W) and the
uint16 kernel layout (A/B-swapped W^T x^T, rows as the narrow side, split-K).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_grouped_matmul as i4

E, K, N, G = 4, 256, 64, 128
PATTERNS = [0b0011, 0b0101, 0b1001, 0b0110, 0b1010, 0b1100]


# Jitted test data (the library's references jit themselves): one program per shape instead of a compile per eager
# operation (same values).
@functools.partial(jax.jit, static_argnames=("sparse", "in_scale"))
def _weights(key, sparse=False, in_scale=False):
  ks = jax.random.split(key, 5)
  rows = K // 4 if sparse else K // 2
  meta = None
  if sparse:
    pats = jnp.asarray(PATTERNS, jnp.int32)[jax.random.randint(ks[3], (E, K // 8, N, 2), 0, 6)]
    meta = (pats[..., 0] | (pats[..., 1] << 4)).astype(jnp.uint8)
  return i4.Int4Weights(
      packed=jax.random.bits(ks[0], (E, rows, N), jnp.uint8),
      scale=jax.random.uniform(ks[1], (E, K // G, N), jnp.float32, 0.01, 0.1),
      zero=jax.random.randint(ks[2], (E, K // G, N), 0, 16).astype(jnp.uint8),
      in_scale=jax.random.uniform(ks[4], (E, K), jnp.float32, 0.5, 2.0) if in_scale else None,
      meta=meta)


@jax.jit
def _ragged_reference(x, ws, gs):
  """ragged_dot of the float32 lhs with the dequantized weight."""
  return jax.lax.ragged_dot(x.astype(jnp.float32), i4.dequantize_int4(ws), gs)


# (group sizes, extra rows owned by no expert): empty experts, one row, all rows in one expert, M not a multiple of
# the 16-row block, trailing rows.
CASES = [([3, 0, 17, 1], 0), ([0, 0, 21, 0], 3), ([0, 0, 0, 0], 2)]


@pytest.mark.parametrize("sizes,extra", CASES)
def test_dense_matches_reference(sizes, extra):
  gs = jnp.asarray(sizes, jnp.int32)
  m = sum(sizes) + extra
  x = jax.random.normal(jax.random.key(len(sizes) + m), (m, K), jnp.float32)
  ws = _weights(jax.random.key(m))
  got = i4.int4_grouped_matmul(x, ws, gs, interpret=True, poison=float("nan"))
  want = i4.int4_grouped_matmul_reference(x, ws, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  assert not np.any(np.asarray(got)[sum(sizes):])  # rows of no expert are zero


@pytest.mark.parametrize("sizes,extra", CASES)
@pytest.mark.parametrize("block_m,split_k", [(None, None), (8, 2)])
def test_nk_layout_matches_reference(sizes, extra, block_m, split_k):
  gs = jnp.asarray(sizes, jnp.int32)
  m = sum(sizes) + extra
  x = jax.random.normal(jax.random.key(len(sizes) + m), (m, K), jnp.float32)
  ws = _weights(jax.random.key(m))
  nk = i4.to_nk_layout(ws)
  got = i4.int4_grouped_matmul(x, nk, gs, interpret=True, poison=float("nan"), block_m=block_m, split_k=split_k)
  want = i4.int4_grouped_matmul_reference(x, ws, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  assert not np.any(np.asarray(got)[sum(sizes):])


def test_nk_layout_round_trips():
  ws = _weights(jax.random.key(7), in_scale=True)
  nk = i4.to_nk_layout(ws)
  assert nk.packed.dtype == jnp.uint16 and nk.packed.shape == (E, N, K // 4)
  np.testing.assert_array_equal(np.asarray(i4.dequantize_int4(nk)), np.asarray(i4.dequantize_int4(ws)))
  with pytest.raises(ValueError, match="2:4"):
    i4.to_nk_layout(_weights(jax.random.key(8), sparse=True))


@pytest.mark.parametrize("unpack,in_scale", [("magic", False), ("magic", True), ("convert", True)])
def test_nk_layout_bf16(unpack, in_scale):
  # bf16 rows: "magic" decodes q as the bf16 128 + q (the zero point absorbs the 128) with group sums from XLA;
  # with activation scales the kernel scales x and sums it itself.
  gs = jnp.asarray([1, 0, 9, 30], jnp.int32)
  x = jax.random.normal(jax.random.key(9), (40, K), jnp.bfloat16)
  ws = _weights(jax.random.key(10), in_scale=in_scale)
  got = np.asarray(i4.int4_grouped_matmul(x, i4.to_nk_layout(ws), gs, interpret=True, poison=float("nan"),
                                          unpack=unpack, split_k=2))
  want = np.asarray(_ragged_reference(x, ws, gs))
  assert np.max(np.abs(got - want)) <= 1e-2 * np.max(np.abs(want))


def test_split_k_must_divide_groups():
  with pytest.raises(ValueError, match="split_k"):
    i4.int4_grouped_matmul(jnp.zeros((4, K)), i4.to_nk_layout(_weights(jax.random.key(0))),
                           jnp.asarray([4, 0, 0, 0]), interpret=True, split_k=3)


def test_sparse_with_activation_scale_bf16():
  gs = jnp.asarray([5, 0, 16, 2], jnp.int32)
  x = jax.random.normal(jax.random.key(1), (23, K), jnp.bfloat16)
  ws = _weights(jax.random.key(2), sparse=True, in_scale=True)
  got = np.asarray(i4.int4_grouped_matmul(x, ws, gs, interpret=True, poison=float("nan"), unpack="magic"))
  # bf16 inputs: the kernel rounds x * in_scale to bf16, the reference rounds the dequantized weight instead.
  want = np.asarray(_ragged_reference(x, ws, gs))
  assert np.max(np.abs(got - want)) <= 1e-2 * np.max(np.abs(want))


def test_sparse_dequant_prunes_two_of_four():
  ws = _weights(jax.random.key(3), sparse=True)
  w = np.asarray(i4.dequantize_int4(ws)).reshape(E, K // G, 4, G // 4, N)  # slot j of quad r: k = r + (G/4) j
  assert np.all(np.sum(w == 0, axis=2) >= 2)


def test_fused_swiglu_matches_reference():
  gs = jnp.asarray([2, 0, 9, 7], jnp.int32)
  x = jax.random.normal(jax.random.key(4), (18, K), jnp.float32)
  gate, up = _weights(jax.random.key(5)), _weights(jax.random.key(6), sparse=True)
  got = i4.int4_grouped_swiglu(x, gate, up, gs, interpret=True, poison=float("nan"))
  want = i4.int4_grouped_swiglu_reference(x, gate, up, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("split_k", [1, 2])
def test_fused_swiglu_nk_layout(split_k):
  gs = jnp.asarray([0, 5, 1, 12], jnp.int32)
  x = jax.random.normal(jax.random.key(11), (20, K), jnp.float32)
  gate, up = _weights(jax.random.key(12)), _weights(jax.random.key(13), in_scale=True)
  got = i4.int4_grouped_swiglu(x, i4.to_nk_layout(gate), i4.to_nk_layout(up), gs, interpret=True,
                               poison=float("nan"), split_k=split_k)
  want = i4.int4_grouped_swiglu_reference(x, gate, up, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
  with pytest.raises(ValueError, match="one layout"):
    i4.int4_grouped_swiglu(x, i4.to_nk_layout(gate), up, gs, interpret=True)


@pytest.mark.parametrize("sizes", [[3, -2, 4, 1], [-2, 6, 0, 2], [3, 0, 4, 9]])
def test_negative_group_sizes_and_sizes_past_m_stay_in_bounds(sizes):
  """group_sizes cannot be checked under jit. A negative size read and wrote rows before the lhs' start (all-NaN
  output in the interpreter, out of bounds on a GPU); sizes summing past M ran the last expert past M. Offsets now
  count a negative size as 0 and stop at M = 8 rows (ragged_dot's contract leaves such sizes undefined): the
  reference on the sizes so cut."""
  gs, x, ws = jnp.asarray(sizes, jnp.int32), jax.random.normal(jax.random.key(9), (8, K)), _weights(jax.random.key(8))
  cut = np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0))]), 8))
  want = np.asarray(i4.int4_grouped_matmul_reference(x, ws, jnp.asarray(cut, jnp.int32)))
  for w in (ws, i4.to_nk_layout(ws)):
    got = np.asarray(i4.int4_grouped_matmul(x, w, gs, interpret=True, poison=float("nan")))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_tile_sizes_and_zero_points_are_checked():
  """block_n=48 or block_m=12 failed in Triton's lowering; a zero-point array smaller than the scales was read past
  its end (or crashed in the interpreter's slicing)."""
  ws, x, gs = _weights(jax.random.key(0)), jnp.zeros((4, K)), jnp.asarray([4, 0, 0, 0])
  with pytest.raises(ValueError, match="block_n=48 must be a power of two >= 16"):
    i4.int4_grouped_matmul(x, ws, gs, block_n=48, interpret=True)
  with pytest.raises(ValueError, match="block_m=12 must be a power of two >= 8"):
    i4.int4_grouped_matmul(x, ws, gs, block_m=12, interpret=True)
  with pytest.raises(ValueError, match=rf"weights.zero has shape \(1, 2, {N}\), not the scale's"):
    i4.int4_grouped_matmul(x, ws._replace(zero=ws.zero[:1]), gs, interpret=True)


def test_k_mismatch_is_rejected():
  with pytest.raises(ValueError, match="pad lhs"):
    i4.int4_grouped_matmul(jnp.zeros((4, K - 8)), _weights(jax.random.key(0)), jnp.asarray([4, 0, 0, 0]),
                           interpret=True)


def test_group_sizes_lhs_rank_and_group_size_mismatch_are_named():
  ws, x = i4.to_nk_layout(_weights(jax.random.key(0)), group_size=G), jnp.zeros((4, K))
  for bad in (jnp.asarray([4, 0, 0]), jnp.asarray([[4, 0, 0, 0]]), jnp.asarray([4.0, 0, 0, 0])):  # before: silent/NaN
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(4,\)"):
      i4.int4_grouped_matmul(x, ws, bad, interpret=True)
  gs = jnp.asarray([4, 0, 0, 0])
  with pytest.raises(ValueError, match="pass the group_size the weights were quantized with"):  # before: silent
    i4.int4_grouped_matmul(x, ws, gs, group_size=64, interpret=True)
  with pytest.raises(ValueError, match=r"lhs must be \[M, Kp\]"):
    i4.int4_grouped_matmul(x[None], ws, gs, interpret=True)


def test_fused_up_weight_and_in_scale_shapes_are_named():
  """Before: an up weight of another N ran with the gate's tiling (wrong columns), a wrong in_scale shape ran."""
  ws, x, gs = _weights(jax.random.key(0)), jnp.zeros((4, K)), jnp.asarray([4, 0, 0, 0])
  wide = ws._replace(packed=jnp.concatenate([ws.packed] * 2, -1), scale=jnp.concatenate([ws.scale] * 2, -1),
                     zero=jnp.concatenate([ws.zero] * 2, -1))
  with pytest.raises(ValueError, match=r"gate and up weights must have one \(E, Kp, N\)"):
    i4.int4_grouped_swiglu(x, ws, wide, gs, interpret=True)
  with pytest.raises(ValueError, match=r"up.in_scale has shape \(4, 128\), expected"):
    i4.int4_grouped_swiglu(x, ws, ws._replace(in_scale=jnp.ones((E, K // 2))), gs, interpret=True)
  with pytest.raises(ValueError, match=r"weights.in_scale has shape \(4, 128\), expected"):
    i4.int4_grouped_matmul(x, ws._replace(in_scale=jnp.ones((E, K // 2))), gs, interpret=True)
