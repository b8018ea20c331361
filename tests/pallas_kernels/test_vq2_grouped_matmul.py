"""vq2 grouped matmul (interpret mode) vs its XLA reference: per-expert and per-layer codebooks, awkward groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import vq2_grouped_matmul as v2

E, K, N, G = 4, 256, 64, 128


def _weights(key, n_codebooks, in_scale=False):
  ks = jax.random.split(key, 4)
  return v2.VQ2Weights(
      idx=jax.random.bits(ks[0], (E, K // 4, N), jnp.uint8),
      codebook=v2.pack_codebook(jax.random.normal(ks[1], (n_codebooks, 256, 4))),
      scale=jax.random.uniform(ks[2], (E, K // G, N), jnp.float32, 0.5, 1.0),
      in_scale=jax.random.uniform(ks[3], (E, K), jnp.float32, 0.5, 2.0) if in_scale else None)


@pytest.mark.parametrize("sizes,extra,n_codebooks", [([3, 0, 17, 1], 2, E), ([0, 20, 0, 0], 0, 1),
                                                     ([1, 1, 1, 1], 0, E)])
def test_matches_reference(sizes, extra, n_codebooks):
  gs = jnp.asarray(sizes, jnp.int32)
  m = sum(sizes) + extra
  x = jax.random.normal(jax.random.key(m), (m, K), jnp.float32)
  ws = _weights(jax.random.key(n_codebooks + m), n_codebooks, in_scale=n_codebooks == 1)
  got = v2.vq2_grouped_matmul(x, ws, gs, interpret=True, poison=float("nan"))
  want = v2.vq2_grouped_matmul_reference(x, ws, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  assert not np.any(np.asarray(got)[sum(sizes):])


def test_codebook_packing_is_exact_for_bf16_values():
  cb = jax.random.normal(jax.random.key(0), (2, 256, 4)).astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(v2.unpack_codebook(v2.pack_codebook(cb))), np.asarray(cb))


def test_fused_swiglu_matches_reference():
  gs = jnp.asarray([4, 4, 0, 9], jnp.int32)
  x = jax.random.normal(jax.random.key(7), (17, K), jnp.float32)
  gate, up = _weights(jax.random.key(8), E), _weights(jax.random.key(9), 1)
  got = v2.vq2_grouped_swiglu(x, gate, up, gs, interpret=True, poison=float("nan"))
  want = v2.vq2_grouped_swiglu_reference(x, gate, up, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)


def test_timing_ablations_do_what_they_say():
  """ablate (timing only): "no_gather" is the kernel with the index bits as the codebook word (no look-up);
  "gather_only" gives each row its expert's column sums of the unscaled codebook vectors (no dots, no scale)."""
  gs = jnp.asarray([5, 0, 9, 2], jnp.int32)
  x = jax.random.normal(jax.random.key(3), (16, K), jnp.float32)
  ws = _weights(jax.random.key(4), E)
  words = jnp.arange(256, dtype=jnp.uint32)[None, :] * jnp.asarray(v2.NO_GATHER_WORDS, jnp.uint32)[:, None]
  as_words = ws._replace(codebook=jnp.broadcast_to(words, (E, 2, 256)))
  got = v2.vq2_grouped_matmul(x, ws, gs, interpret=True, ablate="no_gather")
  np.testing.assert_allclose(np.asarray(got), np.asarray(v2.vq2_grouped_matmul_reference(x, as_words, gs)),
                             rtol=1e-5, atol=1e-3)
  got = np.asarray(v2.vq2_grouped_matmul(x, ws, gs, interpret=True, ablate="gather_only"))
  sums = np.asarray(v2.dequantize_vq2(ws._replace(scale=jnp.ones_like(ws.scale))).sum(axis=1))  # [E, N]
  np.testing.assert_allclose(got, np.repeat(sums, np.asarray(gs), axis=0), rtol=1e-5, atol=1e-3)
  with pytest.raises(ValueError, match="ablate"):
    v2.vq2_grouped_matmul(x, ws, gs, interpret=True, ablate="no_dots")


def test_inconsistent_arguments_are_named():
  """Before: each ran and returned wrong numbers (a scale of another group size: off by up to 83; group sizes for a
  third expert read out of bounds; an up weight of another N fused by the gate's columns)."""
  ws, x, gs = _weights(jax.random.key(0), E), jnp.zeros((4, K)), jnp.asarray([4, 0, 0, 0])
  with pytest.raises(ValueError, match="pass the group_size the weights were quantized with"):
    v2.vq2_grouped_matmul(x, ws, gs, group_size=64, interpret=True)
  with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(4,\)"):
    v2.vq2_grouped_matmul(x, ws, jnp.asarray([4, 0, 0, 0, 0]), interpret=True)
  with pytest.raises(ValueError, match=r"weights.in_scale has shape \(4, 128\), expected"):
    v2.vq2_grouped_matmul(x, ws._replace(in_scale=jnp.ones((E, K // 2))), gs, interpret=True)
  with pytest.raises(ValueError, match=r"lhs must be \[M, Kp\]"):
    v2.vq2_grouped_matmul(x[0], ws, gs, interpret=True)
  wide = ws._replace(idx=jnp.concatenate([ws.idx, ws.idx], -1), scale=jnp.concatenate([ws.scale, ws.scale], -1))
  with pytest.raises(ValueError, match=r"gate and up weights must have one \(E, Kp, N\)"):
    v2.vq2_grouped_swiglu(x, ws, wide, gs, interpret=True)
