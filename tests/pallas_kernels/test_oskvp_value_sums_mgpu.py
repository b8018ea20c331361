"""Mosaic GPU value-sum prototype (Mosaic GPU interpret mode on CPU) vs the XLA reference, exact in int32.

The interpreter takes the wgmma A operand from shared memory and runs no inline Mosaic, so the GPU route (code
words loaded in CODE_LAYOUT, planes extracted in registers, int8 wgmma with A from registers) is checked here by a
numpy emulation of both Mosaic layouts and by lowering it to a Mosaic GPU kernel (whose int8 wgmma instructions are
counted).
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import oskvp_value_sums_mgpu as vs
from pallas_kernels.mosaic_gpu_introspect import mosaic_module_text
from pallas_kernels.oskvp_decode_attention_bitplane import codebook_deltas

Q = 32  # H = 128


@functools.partial(jax.jit, static_argnums=range(1, 5))
def _inputs(seed, bk, s, n, q=Q):
  """One program per shape (op by op, the draws compile a program per operation)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  vcodes = jax.random.bits(k1, (bk, q, s), jnp.uint8)
  p = jax.random.randint(k2, (bk, n, s), -128, 128).astype(jnp.int8)
  return p, vcodes


@pytest.mark.parametrize("bk,s,n,block_s,plane_types,splits,steps,q", [
    (2, 256, 8, 64, 3, 2, 2, Q), (1, 512, 16, 128, 2, 2, 3, Q), (3, 192, 8, 64, 2, 3, 1, Q),
    (1, 256, 16, 64, 3, 1, 4, Q), (1, 128, 8, 64, 2, 1, 2, 2 * Q), (2, 256, 8, 64, 1, 2, 2, Q),
    (1, 256, 16, 128, 1, 1, 2, 2 * Q)])
def test_matches_reference(bk, s, n, block_s, plane_types, splits, steps, q):
  p, vcodes = _inputs(bk * s + n + splits, bk, s, n, q)
  got = vs.value_sums_mgpu(p, vcodes, plane_types=plane_types, block_s=block_s, splits=splits,
                           max_concurrent_steps=steps, interpret=True)
  want = vs.value_sums_split_reference(p, vcodes, splits, plane_types)
  assert got.shape == (bk, splits, plane_types, 4 * q, n) and got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_split_sums_add_up_to_the_total():
  p, vcodes = _inputs(5, 2, 256, 8)
  parts = np.asarray(vs.value_sums_split_reference(p, vcodes, 4))
  np.testing.assert_array_equal(parts.sum(axis=1), np.asarray(vs.value_sums_reference(p, vcodes)))


def test_planes_give_the_codebook_values():
  """c0 Σ_t p_t + Σ_type d_type · acc[type] = p @ V (decoded values): with an integer codebook and integer p the
  kernel's sums, on the cache's codes [S, Q] made token-contiguous, reproduce the decoded values' weighted sum."""
  h, s, n = 4 * Q, 128, 8
  kp, kc, kcb = jax.random.split(jax.random.key(4), 3)
  codes = jax.random.bits(kc, (1, s, Q), jnp.uint8)  # the cache's layout [BK, S, Q]
  cb = jax.random.randint(kcb, (h, 4), -3, 4).astype(jnp.float32)  # [H, 4]
  p = jax.random.randint(kp, (1, n, s), -100, 101).astype(jnp.int8)
  got = vs.value_sums_mgpu(p, vs.token_contiguous(codes), interpret=True)[0, 0]  # [T, H, N]
  d = codebook_deltas(cb)  # [4, H]: c0, d1, d2, d3
  pf = p[0].astype(jnp.float32)  # [N, S]
  out = d[0][:, None] * pf.sum(axis=1)[None] + (d[1:][:, :, None] * got.astype(jnp.float32)).sum(axis=0)  # [H, N]
  c = codes[0].astype(jnp.int32)
  code = jnp.concatenate([(c >> (2 * p_)) & 3 for p_ in range(4)], axis=-1)  # [S, H], channel pQ + j
  values = jnp.take_along_axis(cb[None], code[..., None], axis=-1)[..., 0]  # [S, H]
  np.testing.assert_array_equal(np.asarray(out.T), np.asarray(pf @ values))


def test_token_contiguous_and_append():
  codes = jax.random.bits(jax.random.key(1), (2, 3, 64, Q), jnp.uint8)  # [B, K, S, Q]
  vt = vs.token_contiguous(codes)
  assert vt.shape == (2, 3, Q, 64)
  np.testing.assert_array_equal(np.asarray(vt)[1, 2, 5], np.asarray(codes)[1, 2, :, 5])
  new = jax.random.bits(jax.random.key(2), (2, 3, Q), jnp.uint8)
  got = vs.append_token(vt, new, jnp.int32(17))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(vs.token_contiguous(codes.at[:, :, 17].set(new))))


def test_acc_row_channels_is_the_documented_permutation():
  for q in (Q, 2 * Q):
    rho = np.arange(4 * q)
    p = 2 * (rho // 64 // (q // 32)) + (rho // 8) % 2
    qt = (rho // 64) % (q // 32)
    want = p * q + 32 * qt + 8 * ((rho // 16) % 4) + rho % 8
    np.testing.assert_array_equal(vs.acc_row_channels(q), want)
    assert sorted(want) == list(range(4 * q))


@pytest.mark.parametrize("q,k,plane_types", [(Q, 64, 3), (Q, 128, 2), (2 * Q, 64, 3), (Q, 64, 1), (2 * Q, 128, 1)])
def test_register_planes_are_the_wgmma_operand(q, k, plane_types):
  """The GPU route's per-register extraction, run on numpy models of CODE_LAYOUT and WGMMA_LAYOUT_8BIT, gives the
  planes in ACC row order."""
  codes = np.random.default_rng(q + k).integers(0, 256, (q, k), dtype=np.uint8)
  planes = np.asarray(vs.value_planes_reference(jnp.asarray(codes), plane_types))  # [T·H, K], channel order
  want = planes.reshape(plane_types, 4 * q, k)[:, vs.acc_row_channels(q)].reshape(-1, k)
  np.testing.assert_array_equal(vs.emulate_register_planes(codes, plane_types), want)


def test_emulation_catches_a_wrong_register_mapping(monkeypatch):
  """Swapping the two plane bits of the A register index (M group vs row half) must fail the emulation."""
  good = vs.value_register_index

  def swapped(idx, t, p, q):
    return good(idx, t, 2 * (p % 2) + p // 2, q)

  monkeypatch.setattr(vs, "value_register_index", swapped)
  codes = np.random.default_rng(0).integers(0, 256, (Q, 64), dtype=np.uint8)
  planes = np.asarray(vs.value_planes_reference(jnp.asarray(codes), 2))
  want = planes.reshape(2, 4 * Q, 64)[:, vs.acc_row_channels(Q)].reshape(-1, 64)
  assert not np.array_equal(vs.emulate_register_planes(codes, 2), want)


@pytest.mark.parametrize("a_operand,block_s,n,plane_types", [("registers", 64, 8, 3), ("registers", 128, 16, 2),
                                                              ("smem", 64, 8, 3), ("registers", 64, 8, 1)])
def test_gpu_route_lowers_to_int8_wgmma(a_operand, block_s, n, plane_types):
  p, vcodes = _inputs(0, 2, 1024, n)
  f = jax.jit(lambda p, v: vs.value_sums_mgpu(p, v, plane_types=plane_types, block_s=block_s, splits=2,
                                              a_operand=a_operand))
  text = mosaic_module_text(f.trace(p, vcodes).lower(lowering_platforms=("cuda",)))
  instr = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32\.s32\.s8\.s8) \{[^}]*\}, (\S+)", text)
  # One block: T·H/64 M groups × block_s/32 token (K) steps, emitted once inside the pipeline's loop.
  assert len(instr) == plane_types * 4 * Q // 64 * (block_s // 32)
  assert {i for i, _ in instr} == {f"m64n{n}k32.s32.s8.s8"}
  assert all(a.startswith("{") for _, a in instr) == (a_operand == "registers")  # 4 A registers vs a descriptor
  loop = text[text.index("scf.for"):]
  assert len(re.findall(r"wgmma\.mma_async", loop)) == len(instr)
  ops = collections.Counter(re.findall(r"\barith\.(shrui|andi)\b", text))
  words = Q * block_s // 4 // 128  # 32-bit code words per thread
  assert ops["shrui"] >= (7 if plane_types > 1 else 3) * words
  assert ops["andi"] >= (plane_types * 4 + (plane_types == 3) * 4) * words


def test_rejects_bad_arguments():
  p, vcodes = _inputs(0, 1, 256, 8)
  with pytest.raises(TypeError, match="vcodes"):
    vs.value_sums_mgpu(p, vcodes.astype(jnp.int8), interpret=True)
  with pytest.raises(TypeError, match="p int8"):
    vs.value_sums_mgpu(p.astype(jnp.int32), vcodes, interpret=True)
  with pytest.raises(ValueError, match="vcodes"):
    vs.value_sums_mgpu(p, jnp.swapaxes(vcodes, 1, 2), interpret=True)  # [BK, S, Q]: not token-contiguous
  with pytest.raises(ValueError, match="Q=16"):
    vs.value_sums_mgpu(p, vcodes[:, :16], interpret=True)
  with pytest.raises(ValueError, match="N=12"):
    vs.value_sums_mgpu(jnp.zeros((1, 12, 256), jnp.int8), vcodes, interpret=True)
  with pytest.raises(ValueError, match="plane_types"):
    vs.value_sums_mgpu(p, vcodes, plane_types=4, interpret=True)
  with pytest.raises(ValueError, match="block_s"):
    vs.value_sums_mgpu(p, vcodes, block_s=32, interpret=True)
  with pytest.raises(ValueError, match="splits"):
    vs.value_sums_mgpu(p, vcodes, splits=3, interpret=True)  # 256 tokens not a multiple of 3·64
  with pytest.raises(ValueError, match="a_operand"):
    vs.value_sums_mgpu(p, vcodes, a_operand="tmem", interpret=True)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    vs.value_sums_mgpu(p, vcodes, max_concurrent_steps=0, interpret=True)
