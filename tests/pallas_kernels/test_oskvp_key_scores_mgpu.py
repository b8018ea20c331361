"""Mosaic GPU key-score prototype (Mosaic GPU interpret mode on CPU) vs the XLA reference, exact in int32.

The interpreter takes the wgmma A operand from shared memory and runs no inline Mosaic, so the GPU route (planes
extracted in registers, int8 wgmma with A from registers) is checked here by a numpy emulation of Mosaic's 8-bit
wgmma layout and by lowering it to a Mosaic GPU kernel (whose int8 wgmma instructions are counted).
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels.mosaic_gpu_introspect import mosaic_module_text
from pallas_kernels.oskvp_decode_attention_bitplane import codebook_deltas

Q = 32  # H = 128


@functools.partial(jax.jit, static_argnums=range(1, 5))
def _inputs(seed, bk, s, n, plane_types):
  """One program per shape (op by op, the draws compile a program per operation)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  codes = jax.random.bits(k1, (bk, s, Q), jnp.uint8)
  qd = jax.random.randint(k2, (bk, n, plane_types * 4 * Q), -128, 128).astype(jnp.int8)
  return codes, qd


@pytest.mark.parametrize("bk,s,n,block_s,plane_types", [(2, 128, 8, 64, 3), (1, 256, 16, 128, 2), (3, 64, 8, 64, 2),
                                                        (2, 128, 8, 64, 1)])
def test_matches_reference(bk, s, n, block_s, plane_types):
  codes, qd = _inputs(bk * s + n, bk, s, n, plane_types)
  got = ks.key_scores_mgpu(codes, qd, block_s=block_s, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ks.key_scores_reference(codes, qd)))


def test_planes_give_the_codebook_scores():
  """q . (cb[code] - c0) = sum_type (q * d_type) . plane_type: with an integer codebook and query the int8 digits are
  exact and the kernel's scores equal the decoded keys' dot products."""
  h, g = 4 * Q, 4
  kq, kc, kcb = jax.random.split(jax.random.key(3), 3)
  codes = jax.random.bits(kc, (1, 64, Q), jnp.uint8)
  cb = jax.random.randint(kcb, (h, 4), -3, 4).astype(jnp.float32)  # [H, 4]
  q = jax.random.randint(kq, (g, h), -5, 6).astype(jnp.float32)  # [G, H]
  d = codebook_deltas(cb)  # [4, H]: c0, d1, d2, d3
  qd = jnp.concatenate([q * d[1], q * d[2], q * d[3]], axis=-1)  # [G, 3H], |.| <= 5 * 12
  qd = jnp.concatenate([qd, jnp.zeros_like(qd)], axis=0).astype(jnp.int8)[None]  # N = 8: the second digits zero
  got = np.asarray(ks.key_scores_mgpu(codes, qd, interpret=True))[0, :, :g]  # [S, G]
  c = codes[0].astype(jnp.int32)
  code = jnp.concatenate([(c >> (2 * p)) & 3 for p in range(4)], axis=-1)  # [S, H], channel pQ + j
  keys = jnp.take_along_axis(cb[None], code[..., None], axis=-1)[..., 0] - d[0]  # [S, H]
  np.testing.assert_array_equal(got, np.asarray(keys @ q.T).astype(np.int32))


def test_uniform_codes_give_the_codebook_scores():
  """T = 1: with a uniform codebook cb[c] = c0 + d·c the codes themselves are A and q·d the digits: the scores
  equal the decoded keys' dot products minus q·c0 exactly (integer d and query)."""
  h, g = 4 * Q, 4
  kq, kc, kd = jax.random.split(jax.random.key(5), 3)
  codes = jax.random.bits(kc, (1, 64, Q), jnp.uint8)
  c0 = jnp.linspace(-3.0, 3.0, h)
  d = jax.random.randint(kd, (h,), 1, 5).astype(jnp.float32)
  q = jax.random.randint(kq, (g, h), -5, 6).astype(jnp.float32)  # |q·d| <= 20
  qd = jnp.concatenate([q * d, jnp.zeros_like(q)], axis=0).astype(jnp.int8)[None]  # [1, N = 8, H]
  got = np.asarray(ks.key_scores_mgpu(codes, qd, interpret=True))[0, :, :g]  # [S, G]
  c = codes[0].astype(jnp.int32)
  code = jnp.concatenate([(c >> (2 * p)) & 3 for p in range(4)], axis=-1)  # [S, H]
  keys = c0 + d * code  # [S, H]
  np.testing.assert_array_equal(got, np.asarray(keys @ q.T - c0 @ q.T).round().astype(np.int32))


@pytest.mark.parametrize("m,plane_types", [(64, 3), (128, 2), (64, 1), (128, 1)])
def test_register_planes_are_the_wgmma_operand(m, plane_types):
  """The GPU route's per-register extraction, run on a numpy model of WGMMA_LAYOUT_8BIT, gives the planes."""
  codes = np.random.default_rng(m).integers(0, 256, (m, Q), dtype=np.uint8)
  want = np.asarray(ks.key_planes_reference(jnp.asarray(codes), plane_types))
  np.testing.assert_array_equal(ks.emulate_register_planes(codes, plane_types), want)


@pytest.mark.parametrize("a_operand,block_s,n,plane_types", [("registers", 64, 8, 3), ("registers", 128, 16, 2),
                                                              ("smem", 64, 8, 3), ("registers", 64, 8, 1)])
def test_gpu_route_lowers_to_int8_wgmma(a_operand, block_s, n, plane_types):
  codes, qd = _inputs(0, 1, 256, n, plane_types)
  f = jax.jit(lambda c, q: ks.key_scores_mgpu(c, q, block_s=block_s, a_operand=a_operand))
  text = mosaic_module_text(f.trace(codes, qd).lower(lowering_platforms=("cuda",)))
  instr = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32\.s32\.s8\.s8) \{[^}]*\}, (\S+)", text)
  # One wgmma per 32 channels of K per 64 tokens: (block_s / 64) · T · 4.
  assert len(instr) == block_s // 64 * plane_types * 4
  assert {i for i, _ in instr} == {f"m64n{n}k32.s32.s8.s8"}
  assert all(a.startswith("{") for _, a in instr) == (a_operand == "registers")  # 4 A registers vs a descriptor
  ops = collections.Counter(re.findall(r"\barith\.(shrui|andi)\b", text))
  words = block_s * Q // 4 // 128  # 32-bit code words per thread
  assert ops["shrui"] >= (7 if plane_types > 1 else 3) * words
  assert ops["andi"] >= (plane_types * 4 + (plane_types == 3) * 4) * words


def test_rejects_bad_arguments():
  codes, qd = _inputs(0, 1, 128, 8, 3)
  with pytest.raises(TypeError, match="uint8"):
    ks.key_scores_mgpu(codes.astype(jnp.int8), qd, interpret=True)
  with pytest.raises(ValueError, match="T·H"):
    ks.key_scores_mgpu(codes, qd[..., :100], interpret=True)
  with pytest.raises(ValueError, match="block_s"):
    ks.key_scores_mgpu(codes, qd, block_s=96, interpret=True)
  with pytest.raises(ValueError, match="a_operand"):
    ks.key_scores_mgpu(codes, qd, a_operand="tmem", interpret=True)


# ---- Sequence-loop variant (`key_scores_mgpu_loop`).

@pytest.mark.parametrize("bk,s,n,block_s,plane_types,splits,output,steps", [
    (2, 256, 8, 64, 3, 2, "scores", 2), (2, 384, 8, 64, 3, 3, "max", 2), (1, 512, 16, 128, 2, 2, "max", 3),
    (1, 256, 16, 64, 2, 1, "scores", 4), (2, 384, 8, 64, 1, 3, "max", 2)])
def test_loop_matches_reference(bk, s, n, block_s, plane_types, splits, output, steps):
  codes, qd = _inputs(bk * s + n + splits, bk, s, n, plane_types)
  got = ks.key_scores_mgpu_loop(codes, qd, block_s=block_s, splits=splits, output=output,
                                max_concurrent_steps=steps, interpret=True)
  want = (ks.key_scores_reference(codes, qd) if output == "scores"
          else ks.key_scores_max_reference(codes, qd, splits))
  assert got.shape == want.shape and got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_max_reference_is_the_split_max():
  codes, qd = _inputs(7, 2, 256, 8, 3)
  scores = np.asarray(ks.key_scores_reference(codes, qd))
  got = np.asarray(ks.key_scores_max_reference(codes, qd, 4))
  np.testing.assert_array_equal(got[:, 1], scores[:, 64:128].max(axis=1))


@pytest.mark.parametrize("a_operand,output,block_s,n,plane_types", [("registers", "max", 64, 8, 3),
                                                                     ("registers", "scores", 128, 16, 2),
                                                                     ("smem", "max", 64, 16, 2),
                                                                     ("registers", "max", 64, 8, 1)])
def test_loop_gpu_route_lowers_to_int8_wgmma(a_operand, output, block_s, n, plane_types):
  codes, qd = _inputs(0, 2, 1024, n, plane_types)
  f = jax.jit(lambda c, q: ks.key_scores_mgpu_loop(c, q, block_s=block_s, splits=2, output=output,
                                                   a_operand=a_operand))
  text = mosaic_module_text(f.trace(codes, qd).lower(lowering_platforms=("cuda",)))
  instr = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32\.s32\.s8\.s8) \{[^}]*\}, (\S+)", text)
  # One block's wgmmas, emitted once inside the pipeline's loop over the split's blocks.
  assert len(instr) == block_s // 64 * plane_types * 4
  assert {i for i, _ in instr} == {f"m64n{n}k32.s32.s8.s8"}
  assert all(a.startswith("{") for _, a in instr) == (a_operand == "registers")
  loop = text[text.index("scf.for"):]
  assert len(re.findall(r"wgmma\.mma_async", loop)) == len(instr)


def test_loop_rejects_bad_arguments():
  codes, qd = _inputs(0, 1, 256, 8, 3)
  with pytest.raises(ValueError, match="splits"):
    ks.key_scores_mgpu_loop(codes, qd, splits=3, interpret=True)  # 256 tokens not a multiple of 3·64
  with pytest.raises(ValueError, match="splits"):
    ks.key_scores_mgpu_loop(codes, qd, splits=0, interpret=True)
  with pytest.raises(ValueError, match="output"):
    ks.key_scores_mgpu_loop(codes, qd, output="sum", interpret=True)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    ks.key_scores_mgpu_loop(codes, qd, max_concurrent_steps=0, interpret=True)
  with pytest.raises(ValueError, match="block_s"):
    ks.key_scores_mgpu_loop(codes, qd, block_s=32, interpret=True)
  with pytest.raises(TypeError, match="uint8"):
    ks.key_scores_mgpu_loop(codes.astype(jnp.int8), qd, interpret=True)
