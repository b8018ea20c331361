"""Mosaic GPU vq2 grouped matmul (Mosaic GPU interpret mode on CPU) vs float32 dequantization.

The interpreter runs the warp-specialized pipeline of the int4 kernel with this kernel's codebook protocol (the
compute warpgroups' barrier, the first one's TMA copy of the item's codebook) and leaves unwritten memory NaN, so a
row or column slice that no warpgroup stores fails the comparison. The look-ups run in jnp there; the inline-PTX
look-ups are checked here as far as lowering and on the H200 by `benchmarks/vq2_mgpu_decode.py --check_only`.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_ws_work_table as wt
from pallas_kernels import vq2_grouped_matmul as v2
from pallas_kernels import vq2_grouped_matmul_mgpu_ws as vm
from pallas_kernels.mosaic_gpu_introspect import mosaic_module_text

E, K = 4, 256


@functools.partial(jax.jit, static_argnames=("n", "books", "k"))
def _weights(n, books=E, seed=0, k=K):
  """Random vq2 weights, jitted: one program per shape instead of a compile per eager operation."""
  ks = jax.random.split(jax.random.key(seed), 3)
  return v2.VQ2Weights(jax.random.bits(ks[0], (E, k // 4, n), jnp.uint8),
                       v2.pack_codebook(jax.random.normal(ks[1], (books, 256, 4))),
                       jax.random.uniform(ks[2], (E, k // 128, n), jnp.float32, 0.01, 0.1).astype(jnp.bfloat16))


def test_layout_holds_the_documented_words_and_the_same_values():
  """Word 16q + 4t + 2h + w of column block blk and K group g holds in byte b = 2 bh + p the index of vector
  r = 8 (2w + bh) + 2t + p of column 16 blk + 8h + q (the module docstring), each codebook is stored 16 times
  (entry e's copy l at words 32e + 2l, 32e + 2l + 1), and the layout dequantizes to `dequantize_vq2`'s values
  exactly, per expert and per layer codebooks."""
  for books in (E, 1):
    w = _weights(64, books, seed=books)
    m = vm.to_mgpu_layout(w)
    assert m.idx.shape == (E, 4, 2, 128) and m.idx.dtype == jnp.int32 and m.codebook.shape == (books, 64, 128)
    words = np.asarray(jax.lax.bitcast_convert_type(m.idx, jnp.uint32))
    idx = np.asarray(w.idx)
    rng = np.random.default_rng(books)
    for _ in range(200):
      e, blk, g, q, t, h, wd, b = (int(rng.integers(0, s)) for s in (E, 4, 2, 8, 4, 2, 2, 4))
      r = 8 * (2 * wd + b // 2) + 2 * t + b % 2
      got = (words[e, blk, g, 16 * q + 4 * t + 2 * h + wd] >> (8 * b)) & 0xFF
      assert got == idx[e, 32 * g + r, 16 * blk + 8 * h + q]
    cb = np.asarray(m.codebook).reshape(books, 256, 16, 2)
    np.testing.assert_array_equal(cb, np.broadcast_to(np.swapaxes(np.asarray(w.codebook), 1, 2)[:, :, None], cb.shape))
    np.testing.assert_array_equal(np.asarray(vm.dequantize_mgpu(m)), np.asarray(v2.dequantize_vq2(w)))


# (group sizes, rows of no expert, N, codebooks, kernel config). Items per CTA: 1 to 3 (START, STEADY, STOP), an idle
# CTA, codebook changes between a CTA's items, virtual-expert tiles (zeros), N tiles that overlap, C = 1, 2, 4 (C = 3
# starves the interpreter on 2 cores, see test_int4_grouped_matmul_mgpu_ws.py; it is checked on the H200).
CASES = [
    ([3, 0, 17, 1], 2, 256, E, dict(num_compute_wgs=2, block_k=128, num_ctas=3, block_r=16)),
    ([5, 0, 2, 9], 0, 128, E, dict(num_ctas=1, max_concurrent_steps=1)),  # one CTA: 3 items, 3 codebooks
    ([1, 1, 1, 1], 0, 128, 1, dict(num_ctas=5)),  # one item per CTA, one CTA idle; one codebook
    ([0, 0, 0, 0], 2, 192, E, dict(num_compute_wgs=2, num_ctas=2)),  # only the virtual expert's rows: zeros
    ([0, 1, 9, 0], 3, 320, E, dict(num_compute_wgs=2, num_ctas=3)),  # tiles at 0, 128, 192 (overlap 64)
    ([2, 7, 0, 3], 1, 64, 1, dict(num_compute_wgs=1, num_ctas=2)),
    ([3, 0, 17, 1], 2, 256, 1, dict(num_ctas=2)),  # the default C = 4 where 256 divides N
]


@pytest.mark.parametrize("sizes,extra,n,books,cfg", CASES)
def test_matches_float32_dequantization(sizes, extra, n, books, cfg, interpreted):
  """Within 1e-5 of the largest output (float32 dequantization at HIGHEST precision on the same bf16 lhs; the kernel
  multiplies exact bf16 codewords and scales float32 accumulators), rows past the groups exactly zero."""
  w = vm.to_mgpu_layout(_weights(n, books, seed=n + books))
  m = sum(sizes) + extra
  x = jax.random.normal(jax.random.key(m), (m, K), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  got = np.asarray(interpreted(lambda: vm.vq2_grouped_matmul_mgpu_ws(x, w, gs, interpret=True, **cfg)))
  want = np.asarray(vm.vq2_grouped_matmul_mgpu_ws_reference(x, w, gs))
  rows = sum(sizes)
  assert got.shape == (m, n) and not np.isnan(got).any()
  np.testing.assert_allclose(got[:rows], want[:rows], rtol=1e-5, atol=1e-5 * max(np.abs(want).max(), 1e-30))
  assert not np.any(got[rows:])


def test_sizes_past_m_stay_in_bounds(interpreted):
  """[20, 20] rows for M = 24: an out-of-bounds copy before; the rows stop at M (expert 1 gets rows 20-23)."""
  w = vm.to_mgpu_layout(_weights(64, seed=3))
  x = jax.random.normal(jax.random.key(24), (24, K), jnp.bfloat16)
  got = np.asarray(interpreted(lambda: vm.vq2_grouped_matmul_mgpu_ws(x, w, jnp.asarray([20, 20, 0, 0], jnp.int32),
                                                                     interpret=True, num_ctas=2)))
  want = np.asarray(vm.vq2_grouped_matmul_mgpu_ws_reference(x, w, jnp.asarray([20, 4, 0, 0], jnp.int32)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.fixture
def table_in_jnp(monkeypatch):
  """Lowering for CUDA on the CPU: the work table's Triton kernel needs a GPU to lower, so take its jnp reference."""
  monkeypatch.setattr(wt, "work_table", wt.work_table_reference)


@pytest.mark.parametrize("books,cfg", [(E, {}), (1, {}), (E, dict(num_compute_wgs=3, block_k=512, block_r=32))])
def test_gpu_path_lowers_with_one_lookup_per_vector(books, cfg, table_in_jnp):
  """The GPU path (inline-PTX look-ups, wgmma from registers, the codebook's barrier protocol) lowers to a Mosaic GPU
  kernel with 16 `ld.shared.v2.b32` look-ups per compute thread and K group (8 vectors for each of its 2 rows) in
  each of the 4 pipeline forms (one item; START, STEADY, STOP), and per 2 look-ups 4 prmt for the registers and 2
  for the index bytes (the default index_extract="prmt")."""
  w = vm.to_mgpu_layout(_weights(512, books, k=1024))
  x, gs = jnp.ones((64, 1024), jnp.bfloat16), jnp.full((E,), 16, jnp.int32)
  f = jax.jit(functools.partial(vm.vq2_grouped_matmul_mgpu_ws, num_ctas=132, **cfg))
  text = mosaic_module_text(f.trace(x, w, gs).lower(lowering_platforms=("cuda",)))
  groups = cfg.get("block_k", 256) // 128
  assert len(re.findall(r"ld\.shared\.v2\.b32", text)) == 16 * groups * 4
  assert len(re.findall(r"prmt\.b32", text)) == 48 * groups * 4


def test_prmt_index_extract_trades_the_shift_and_and_for_one_prmt(table_in_jnp):
  """index_extract="prmt" lowers with the same 16 look-ups per compute thread, K group and pipeline form, one more prmt
  per look-up (48 instead of 32) and 16 ands fewer (the byte's mask)."""
  w = vm.to_mgpu_layout(_weights(512, k=1024))
  x, gs = jnp.ones((64, 1024), jnp.bfloat16), jnp.full((E,), 16, jnp.int32)
  texts = {}
  for form in ("shift", "prmt"):
    f = jax.jit(functools.partial(vm.vq2_grouped_matmul_mgpu_ws, num_ctas=132, index_extract=form))
    texts[form] = mosaic_module_text(f.trace(x, w, gs).lower(lowering_platforms=("cuda",)))
  per_kernel = 2 * 4  # K groups per step (block_k 256) x pipeline forms
  for form, prmts in (("shift", 32), ("prmt", 48)):
    assert len(re.findall(r"ld\.shared\.v2\.b32", texts[form])) == 16 * per_kernel
    assert len(re.findall(r"prmt\.b32", texts[form])) == prmts * per_kernel
  ands = {form: len(re.findall(r"arith\.andi", text)) for form, text in texts.items()}
  assert ands["shift"] - ands["prmt"] == 16 * per_kernel


def test_no_decode_ablation_multiplies_the_scales(interpreted):
  """ablate="no_decode" (timing only) gives every wgmma the constant operand 1 and keeps the per-group scaling and the
  stores, so out[m] = x[m] @ S[e(m)] with S[e, k, n] = s[e, k // 128, n]."""
  sizes = [3, 0, 17, 1]
  w = vm.to_mgpu_layout(_weights(128, seed=5))
  x = jax.random.normal(jax.random.key(6), (sum(sizes) + 2, K), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  got = np.asarray(interpreted(lambda: vm.vq2_grouped_matmul_mgpu_ws(x, w, gs, interpret=True, ablate="no_decode",
                                                                     num_compute_wgs=2)))
  s = jnp.repeat(w.scale.astype(jnp.float32), 128, axis=1)  # [E, K, N]
  want = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), s, gs, precision=jax.lax.Precision.HIGHEST))
  np.testing.assert_allclose(got[:21], want[:21], rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.any(got[21:])


@pytest.mark.parametrize("ablate,lookups,prmts", [("no_lookup", 0, 48), ("no_decode", 0, 0)])
def test_timing_ablations_lower_without_their_part(ablate, lookups, prmts, table_in_jnp):
  """The timing ablations lower for CUDA without the part they leave out: no_lookup has no codebook loads but its
  prmts (the registers' and the index bytes'), no_decode neither (per K group and pipeline form, as in the kernel's
  own lowering test)."""
  w = vm.to_mgpu_layout(_weights(512, k=1024))
  x, gs = jnp.ones((64, 1024), jnp.bfloat16), jnp.full((E,), 16, jnp.int32)
  f = jax.jit(functools.partial(vm.vq2_grouped_matmul_mgpu_ws, num_ctas=132, ablate=ablate))
  text = mosaic_module_text(f.trace(x, w, gs).lower(lowering_platforms=("cuda",)))
  assert len(re.findall(r"ld\.shared\.v2\.b32", text)) == lookups * 2 * 4
  assert len(re.findall(r"prmt\.b32", text)) == prmts * 2 * 4


def test_refusals_name_the_field():
  w = _weights(128)
  m = vm.to_mgpu_layout(w)
  x, gs = jnp.ones((8, K), jnp.bfloat16), jnp.asarray([2, 2, 2, 2], jnp.int32)
  with pytest.raises(TypeError, match="weights must come from to_mgpu_layout, got VQ2Weights"):
    vm.vq2_grouped_matmul_mgpu_ws(x, w, gs)
  with pytest.raises(TypeError, match="lhs must be bfloat16, got float32"):
    vm.vq2_grouped_matmul_mgpu_ws(x.astype(jnp.float32), m, gs)
  with pytest.raises(ValueError, match="lhs has K=128 but the vq2 weights hold Kp=256"):
    vm.vq2_grouped_matmul_mgpu_ws(x[:, :128], m, gs)
  with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(4,\) .* int32 \(3,\)"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m, gs[:3])
  with pytest.raises(ValueError, match=r"group_sizes must be an integer array .* float32 \(4,\)"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m, gs.astype(jnp.float32))  # before: truncated
  with pytest.raises(ValueError, match="N=96 must be a multiple of 64"):
    vm.vq2_grouped_matmul_mgpu_ws(x, vm.to_mgpu_layout(_weights(96)), gs)
  with pytest.raises(ValueError, match="block_k=384 must be a multiple of 128 dividing the padded K = 256"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m, gs, block_k=384)
  with pytest.raises(ValueError, match=r"codebook shape \(2, 64, 128\) must be \(1 or E=4"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m._replace(codebook=m.codebook[:2]), gs)
  with pytest.raises(ValueError, match="ablate='bogus' must be one of"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m, gs, ablate="bogus")
  with pytest.raises(ValueError, match="index_extract='lut' must be one of"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m, gs, index_extract="lut")
  with pytest.raises(ValueError, match="ablate='no_lookup' takes the GPU's look-ups"):
    vm.vq2_grouped_matmul_mgpu_ws(x, m, gs, ablate="no_lookup", interpret=True)
  with pytest.raises(ValueError, match="group_size=64 must be 128"):
    vm.to_mgpu_layout(w, group_size=64)
  with pytest.raises(ValueError, match="without an activation scale"):
    vm.to_mgpu_layout(w._replace(in_scale=jnp.ones((E, K))))
