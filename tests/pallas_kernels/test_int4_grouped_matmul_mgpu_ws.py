"""Warp-specialized Mosaic GPU int4 grouped matmul (Mosaic GPU interpret mode on CPU) vs the XLA reference.

The interpreter runs the warp-specialized pipeline itself: the TMA warpgroup and the compute warpgroups as threads,
the produced/consumed barriers, the chained START / STEADY / STOP pipelines of a persistent CTA, and the stores of
each compute warpgroup. It leaves unwritten memory NaN, so a row or column slice that no warpgroup stores fails the
comparison. `setmaxnreg` is a no-op there, and the GPU-only pieces (registers reinterpreted as wgmma fragments, the
PTX dequant) are checked here only as far as lowering to a Mosaic GPU kernel; `benchmarks/int4_mgpu_ws_decode.py`
checks their values on the H200.
"""

import functools
import re

import jax
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np
import pytest

from pallas_kernels import int4_gate_up_mgpu as gu
from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import int4_grouped_matmul_mgpu as mg
from pallas_kernels import int4_grouped_matmul_mgpu_ws as ws
from pallas_kernels import int4_ws_work_table as wt
from pallas_kernels.mosaic_gpu_introspect import mosaic_module_text

E, K, G = 4, 256, 128


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draw(m, n):
  """x [m, K] and int4 weights [E, K, n]: jitted, one program per shape instead of a compile per eager operation."""
  ks = jax.random.split(jax.random.key(31 * m + n), 4)
  w = i4.Int4Weights(
      packed=jax.random.bits(ks[0], (E, K // 2, n), jnp.uint8),
      scale=jax.random.uniform(ks[1], (E, K // G, n), jnp.float32, 0.01, 0.1).astype(jnp.bfloat16),
      zero=jax.random.randint(ks[2], (E, K // G, n), 0, 16).astype(jnp.uint8))
  x = jax.random.normal(ks[3], (m, K), jnp.bfloat16)
  return x, w


def _inputs(sizes, extra, n):
  x, w = _draw(sum(sizes) + extra, n)
  return x, jnp.asarray(sizes, jnp.int32), w


# (group sizes, rows of no expert, N, kernel config). Items per CTA: 2 (START, STOP), 3 (+ STEADY), 1 (no chaining),
# 0 (an idle CTA); virtual-expert tiles (zeros), several tiles per expert, two N tiles, 1 or 2 compute warpgroups.
# Three compute warpgroups (4 threads per CTA) starve the interpreter on 2 cores several tries in a row
# (`interpreter_watchdog.py`): C = 3 is checked here by lowering (`test_gpu_path_lowers`) and on the GPU by
# `benchmarks/int4_mgpu_ws_decode.py`'s checks. Cases with 16-row tiles at N >= 192 therefore give C = 2, which the
# default (`default_compute_wgs`) would now make 3.
CASES = [
    # C = 2 given where the default would now be 3 (16-row tiles, N = 256 not filled by C = 4).
    ([3, 0, 17, 1], 2, 256, dict(num_compute_wgs=2, block_k=128, num_ctas=3, block_r=16)),  # 5 tiles x 2 N tiles over
    # 3 CTAs, ring of 2
    ([5, 0, 2, 9], 0, 128, dict(num_ctas=1, max_concurrent_steps=1)),  # 3 items in one CTA: START, STEADY, STOP
    ([1, 1, 1, 1], 0, 128, dict(num_ctas=5)),  # one item per CTA, one CTA idle
    ([0, 0, 0, 0], 2, 192, dict(num_compute_wgs=2, num_ctas=2)),  # only the virtual expert's rows: zeros
    ([2, 7, 0, 3], 1, 128, dict(num_compute_wgs=1, block_k=128, num_ctas=2)),
    # N not a multiple of the N tile: the last tile starts at N - 64·C and its first warpgroups do not store.
    ([0, 1, 9, 0], 3, 320, dict(num_compute_wgs=2, num_ctas=3)),  # tiles at 0, 128 and 192 (overlap 64)
    ([4, 0, 1, 12], 0, 256, dict(num_compute_wgs=2, num_ctas=2, block_k=128)),  # tiles at 0 and 128 (no overlap)
    ([2, 1, 0, 0], 5, 192, dict(num_compute_wgs=2, num_ctas=1)),  # C = 2, tiles at 0 and 64; one CTA
    ([3, 0, 17, 1], 2, 320, dict(num_compute_wgs=4, block_k=128, num_ctas=2)),  # C = 4: tiles at 0 and 64 (overlap)
    # overlap_steps: a step releases the previous step's ring slot, the item's end its last one (manual barriers).
    ([3, 0, 17, 1], 2, 256, dict(num_compute_wgs=2, block_k=128, num_ctas=3, block_r=16, overlap_steps=True)),  # ring
    # of 2, chained
    ([5, 0, 2, 9], 0, 320, dict(num_compute_wgs=2, block_k=128, num_ctas=1, overlap_steps=True)),  # START..STOP
    ([1, 1, 1, 1], 0, 128, dict(num_ctas=5, block_k=128, overlap_steps=True)),  # one item per CTA, one idle
    # The cases above take aligned tiles (the default: windows of W = R rows, wgmma N = 8 at R = 8; experts that start
    # off a multiple of 8 take one more tile); padded tiles (W = R + 8), the first form:
    ([3, 0, 17, 1], 2, 256, dict(block_k=128, num_ctas=3, aligned_tiles=False)),  # R = 8, W = 16, virtual rows
    ([5, 0, 2, 9], 3, 128, dict(num_ctas=2, block_r=16, aligned_tiles=False)),  # R = 16, W = 24
    # Wider aligned tiles: an expert's 17 rows (starting at row 3) in one 24- or 32-row window, store ladder to 16.
    ([3, 0, 17, 1], 2, 128, dict(num_ctas=2, block_r=24)),
    ([3, 0, 17, 1], 2, 128, dict(num_ctas=3, block_r=32, block_k=128)),
    # One K group's wgmma in flight: each step waits for group 0's before decoding group 1 (the interpreter's route
    # waits after every wgmma anyway: this runs the option's code path; `test_wgmma_depth_waits_within_the_step`
    # checks the waits in the GPU lowering).
    ([3, 0, 17, 1], 2, 128, dict(num_ctas=2, block_k=256, wgmma_depth=1)),
]


@pytest.mark.parametrize("sizes,extra,n,cfg", CASES)
def test_matches_reference(sizes, extra, n, cfg, interpreted):
  x, gs, w = _inputs(sizes, extra, n)
  wm = ws.to_mgpu_layout(w)
  got = np.asarray(interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(x, wm, gs, interpret=True, **cfg)))
  # The default form (acc_scale; sub_mul with overlap_steps) against its reference: float32 accumulation in another
  # order.
  form = "sub_mul" if cfg.get("overlap_steps") else "acc_scale"
  want = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(x, wm, gs, form))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
  assert not np.any(got[sum(sizes):])  # rows of no expert are zero


@pytest.mark.parametrize("sizes,m", [([3, -2, 4, 1], 8), ([20, 20, 0, 0], 24)])
def test_negative_sizes_and_sizes_past_m_stay_in_bounds(sizes, m, interpreted):
  """Sizes summing past M made the work table's tiles store past the output and read shared memory past their
  window (an out-of-bounds copy in the interpreter); they now count from 0 and stop at M, in the table's prefix."""
  x, w = _draw(m, 128)
  wm = ws.to_mgpu_layout(w)
  got = np.asarray(interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(x, wm, jnp.asarray(sizes, jnp.int32),
                                                                      interpret=True, num_ctas=2)))
  cut = jnp.asarray(np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0))]), m)), jnp.int32)
  want = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(x, wm, cut, "acc_scale"))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
  with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(4,\)"):
    ws.int4_grouped_matmul_mgpu_ws(x, wm, jnp.asarray([m], jnp.int32), interpret=True)


# (gate group sizes, rows of no expert, F, kernel config) of the fused gate/up + SwiGLU form: 2F = 192 columns in N
# tiles at 0 and 64 (the second tile's first warpgroup does not store), virtual rows; one CTA chaining 3 items with
# 16-row tiles and a ring of 1.
SWIGLU_CASES = [([3, 0, 17, 1], 2, 96, dict(num_compute_wgs=2, block_k=128, num_ctas=2)),
                ([5, 0, 2, 9], 0, 64, dict(num_ctas=1, block_r=16, max_concurrent_steps=1))]


@pytest.mark.parametrize("sizes,extra,f,cfg", SWIGLU_CASES)
def test_swiglu_matches_reference(sizes, extra, f, cfg, interpreted):
  """swiglu=True on `interleave_gate_up(gate, up)` gives silu(x W_gate) · (x W_up) [M, F] (each weight's float32
  dequantization, as acc_scale computes it); rows of no expert are zero."""
  x, gs, wg = _inputs(sizes, extra, f)
  wu = ws.to_mgpu_layout(_inputs([1, 2, 3, 4], 0, f)[2])
  wg = ws.to_mgpu_layout(wg)
  got = np.asarray(interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(x, gu.interleave_gate_up(wg, wu), gs,
                                                                      interpret=True, swiglu=True, **cfg)))
  ref = functools.partial(ws.int4_grouped_matmul_mgpu_ws_form_reference, x, group_sizes=gs, dequant_form="acc_scale")
  want = np.asarray(jax.nn.silu(ref(weights=wg)) * ref(weights=wu))
  assert got.shape == (x.shape[0], f)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
  assert not np.any(got[sum(sizes):])


def test_interleave_gate_up_orders_columns():
  """Columns of the interleaved weight go 32 of gate, the same 32 of up, the next 32 of gate, ..., and `split_gate_up`
  undoes it; mismatched weights and an F that is not a multiple of 32 are refused."""
  _, _, w = _inputs([1, 2, 3, 4], 0, 64)
  wg, wu = ws.to_mgpu_layout(w), ws.to_mgpu_layout(_inputs([2, 1, 3, 4], 0, 64)[2])
  both = gu.interleave_gate_up(wg, wu)
  assert type(both) is type(wg) and both.q.shape == (E, 128, K) and both.scale.shape == (E, K // G, 128)
  dg, du, dgu = (np.asarray(mg.dequantize_mgpu(v)) for v in (wg, wu, both))
  for b in range(2):
    np.testing.assert_array_equal(dgu[..., 64 * b:64 * b + 32], dg[..., 32 * b:32 * b + 32])
    np.testing.assert_array_equal(dgu[..., 64 * b + 32:64 * b + 64], du[..., 32 * b:32 * b + 32])
  split = gu.split_gate_up(jnp.asarray(dgu))  # its inverse on the dequantized weight
  np.testing.assert_array_equal(np.asarray(split[0]), dg)
  np.testing.assert_array_equal(np.asarray(split[1]), du)
  with pytest.raises(ValueError, match="same layout and shapes"):
    gu.interleave_gate_up(wg, ws.to_mgpu_layout(w, nibble_order="prmt"))
  with pytest.raises(ValueError, match="F=48"):
    gu.interleave_gate_up(*(v._replace(q=v.q[:, :48], scale=v.scale[..., :48], zero=v.zero[..., :48])
                            for v in (wg, wu)))


@pytest.mark.parametrize("cfg", [dict(num_compute_wgs=3, block_k=256, block_r=16),
                                 dict(num_compute_wgs=4, block_k=256, block_r=32), dict(block_k=512, block_r=8)])
def test_swiglu_gpu_path_lowers(cfg, table_in_jnp):
  """The fused form's epilogue (gate and up halves read back from shared memory, silu · up, 32-column stores)
  lowers for CUDA."""
  x, gs, w = _inputs_k512("shift")
  half = w._replace(q=w.q[:, :128], scale=w.scale[..., :128], zero=w.zero[..., :128])
  f = jax.jit(lambda a, w, g: ws.int4_grouped_matmul_mgpu_ws(a, w, g, num_ctas=132, swiglu=True, **cfg))
  text = f.trace(x, gu.interleave_gate_up(half, half), gs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_no_decode_ablation_multiplies_the_scales(interpreted):
  """ablate="no_decode" (timing only) gives every wgmma the constant operand q - z = 1 and keeps the per-group
  scaling and the stores, so out[m] = x[m] @ S[e(m)] with S[e, k, n] = s[e, k // 128, n]; it takes acc_scale only."""
  sizes, extra = [3, 0, 17, 1], 2
  x, gs, w = _inputs(sizes, extra, 128)
  wm = ws.to_mgpu_layout(w, nibble_order="shift")
  got = np.asarray(interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(x, wm, gs, interpret=True, num_ctas=2,
                                                                      ablate="no_decode")))
  scales = jnp.repeat(wm.scale.astype(jnp.float32), G, axis=1)  # [E, Kp, N]
  want = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), scales, gs, precision=jax.lax.Precision.HIGHEST))
  np.testing.assert_allclose(got[:sum(sizes)], want[:sum(sizes)], rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.any(got[sum(sizes):])
  with pytest.raises(ValueError, match="no_decode.*acc_scale"):
    ws.int4_grouped_matmul_mgpu_ws(x, wm, gs, interpret=True, ablate="no_decode", dequant_form="sub_mul")


# (form, nibble order): every form in the prmt order (K_ORDER), every form but fma16 in the shift order.
FORM_ORDERS = [(f, "prmt") for f in ws.DEQUANT_FORMS] + [(f, "shift") for f in ws.DEQUANT_FORMS if f != "fma16"]


@pytest.mark.parametrize("form,order", FORM_ORDERS)
def test_dequant_forms_match_their_reference(form, order, interpreted):
  """Each dequant form gives its own reference's values (interpret mode reproduces the form's rounding) and stays
  within the form's stated distance of the bf16 reference, in either nibble order."""
  x, gs, w = _inputs([3, 0, 17, 1], 2, 256)
  wm = ws.to_mgpu_layout(w, nibble_order=order)
  got = np.asarray(interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(
      x, wm, gs, interpret=True, num_compute_wgs=2, block_k=128, num_ctas=3, block_r=16, dequant_form=form)))
  want = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(x, wm, gs, form))
  # acc_zero subtracts (128 + z) · xsum from sum x (128 + q): float32 cancellation, ~1e-6 of the largest output.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
  ref = np.asarray(i4.int4_grouped_matmul_reference(x, w, gs))
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert err < {"sub_mul": 1e-5, "acc_scale": 1e-2, "acc_zero": 1e-2, "fma16": 3e-2, "fma128": 2e-1}[form], err
  if form == "sub_mul":
    np.testing.assert_array_equal(want, ws.int4_grouped_matmul_mgpu_ws_reference(x, wm, gs))


@pytest.mark.parametrize("sizes,extra,n,cfg", [
    # block_k 256 (gk 2), padded tiles W 24: the x-sum tile padded to 32.
    ([3, 0, 17, 1], 2, 256, dict(num_compute_wgs=2, num_ctas=3, block_r=16, aligned_tiles=False)),
    # Overlapping last N tile (C = 2 at N = 192: tiles at 0 and 64).
    ([2, 1, 0, 0], 5, 192, dict(num_compute_wgs=2, num_ctas=1)),
    ([5, 0, 2, 9], 0, 128, dict(num_ctas=1, max_concurrent_steps=1, block_k=128)),  # START, STEADY, STOP
])
def test_acc_zero_shift_order_matches_reference(sizes, extra, n, cfg, interpreted):
  """The shift nibble order with the zero point on the accumulator (acc_zero), over chained items and N tiles,
  exact against float32 dequantization up to the float32 cancellation of its 128 · xsum (stated: 1e-5)."""
  x, gs, w = _inputs(sizes, extra, n)
  wm = ws.to_mgpu_layout(w, nibble_order="shift")
  got = np.asarray(interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(x, wm, gs, interpret=True,
                                                                      dequant_form="acc_zero", **cfg)))
  want = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(x, wm, gs, "acc_zero"))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
  assert not np.any(got[sum(sizes):])


def test_shift_order_keeps_the_weight():
  """Both nibble orders hold the same weight: the same XLA reference, and q permuted within each block of 32."""
  x, gs, w = _inputs([3, 0, 17, 1], 2, 256)
  wp, wsh = ws.to_mgpu_layout(w, nibble_order="prmt"), ws.to_mgpu_layout(w)  # the WS default: shift
  assert isinstance(wsh, ws.MgpuInt4WeightsShift) and mg.nibble_order(wsh) == "shift"
  assert isinstance(wp, ws.MgpuInt4Weights) and mg.nibble_order(wp) == "prmt"
  np.testing.assert_array_equal(ws.int4_grouped_matmul_mgpu_ws_reference(x, wp, gs),
                                ws.int4_grouped_matmul_mgpu_ws_reference(x, wsh, gs))
  qp = np.asarray(wp.q, np.int32).reshape(E, -1, 32)[..., np.argsort(mg.K_ORDER)]
  qs = np.asarray(wsh.q, np.int32).reshape(E, -1, 32)[..., np.argsort(mg.K_ORDER_SHIFT)]
  np.testing.assert_array_equal(qp, qs)
  assert sorted(mg.K_ORDER_SHIFT) == list(range(32))


def test_fma_forms_round_as_predicted():
  """The fma forms' weight error against the exact (q - z) s is bounded by the rounding of the per-group constant
  (half an ulp of (bias + z) s) plus half an ulp of the weight."""
  _, _, w = _inputs([1], 0, 256)
  wm = ws.to_mgpu_layout(w)
  eye = jnp.eye(K, dtype=jnp.bfloat16)
  exact = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(eye, wm, jnp.asarray([K, 0, 0, 0]), "acc_scale"))
  scale = np.repeat(np.asarray(w.scale[0], np.float32), G, axis=0)  # [K, N]
  for form, bias in (("fma128", 128), ("fma16", 16)):
    got = np.asarray(ws.int4_grouped_matmul_mgpu_ws_form_reference(eye, wm, jnp.asarray([K, 0, 0, 0]), form))
    bound = (bias + 15) * scale * 2.0**-8 + np.abs(exact) * 2.0**-8  # ulp(v) <= |v| 2^-7 in bf16
    assert np.all(np.abs(got - exact) <= bound), form


def _bf16(v):
  return np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _run_ptx(asm, ops):
  """numpy model of the dequant PTX text: `ops` = [$1, $2, ...] (uint32 arrays); prmt (default mode), lop3 with
  0x6A ((a & b) ^ c), and sub / mul / fma.rn on bf16x2 (each half rounded to bf16). Returns $0 as two float64 halves
  (bf16 values)."""
  regs = {f"${i + 1}": v for i, v in enumerate(ops)}
  val = lambda r: regs[r] if r in regs else np.uint32(int(r, 16))
  halves = lambda v: [(((v >> np.uint32(16 * h)) & np.uint32(0xFFFF)) << np.uint32(16)).view(np.float32)
                      .astype(np.float64) for h in (0, 1)]
  for line in asm.splitlines():  # the formatted text: "{", ".reg ...", one instruction per line, "}"
    if line in ("{", "}") or line.startswith(".reg"):
      continue
    op, args = line.rstrip(";").split(None, 1)
    args = [a.strip() for a in args.split(",")]
    if op == "prmt.b32":
      a, b, sel = val(args[1]), val(args[2]), int(args[3], 16)
      byte = lambda i: ((a if i < 4 else b) >> np.uint32(8 * (i % 4))) & np.uint32(0xFF)
      # selector F (bytes 1 and 3) replicates a sign bit; those bytes are masked by the lop3 below: take 0
      regs[args[0]] = sum((byte((sel >> (4 * j)) & 7) if (sel >> (4 * j)) & 15 != 15 else np.uint32(0)) <<
                          np.uint32(8 * j) for j in range(4)).astype(np.uint32)
    elif op == "lop3.b32":
      assert args[4] == "0x6A"
      regs[args[0]] = (val(args[1]) & val(args[2])) ^ val(args[3])
    else:  # bf16x2 arithmetic, per half
      xs = [halves(val(a)) for a in args[1:]]
      f = {"sub.bf16x2": lambda a, b: a - b, "mul.bf16x2": lambda a, b: a * b,
           "fma.rn.bf16x2": lambda a, b, c: a * b + c}[op]
      res = [_bf16(f(*[x[h] for x in xs])) for h in (0, 1)]
      regs[args[0]] = sum(((np.asarray(r, np.float32).view(np.uint32) >> np.uint32(16)) << np.uint32(16 * h))
                          for h, r in enumerate(res)).astype(np.uint32)
  return halves(regs["$0"])


@pytest.mark.parametrize("form,order", FORM_ORDERS)
def test_form_asm_bits(form, order):
  """The PTX of each form in each nibble order (run on the GPU only) decodes every stored nibble of a thread's word
  into the form's weight at the right K position: a numpy model of the PTX text (`form_asm`) and of the word's
  shifts (`dequant_registers`), against the form's formula, with the pair of column block `part` of thread p holding
  k = 8 part + 2p + half, where the order stores it (K_ORDER / K_ORDER_SHIFT)."""
  rng = np.random.default_rng(0)
  nib = rng.integers(0, 16, (4096, 8)).astype(np.uint32)  # stored nibbles c & 15 = q ^ 8
  word = (nib << (4 * np.arange(8, dtype=np.uint32))).sum(1).astype(np.uint32)
  s = jnp.asarray(rng.uniform(0.001, 0.1, 4096), jnp.bfloat16)
  z = jnp.asarray(rng.integers(0, 16, 4096) - 8, jnp.bfloat16)  # z - 8
  rows = [np.asarray(v.astype(jnp.float32), np.float32).view(np.uint32) >> np.uint32(16)
          for v in ws._row_operands(form, s, z)]  # pylint: disable=protected-access
  rows = [r | (r << np.uint32(16)) for r in rows]  # the row value in both halves
  s64, z64 = np.asarray(s, np.float64), np.asarray(z, np.float64) + 8
  bias = ws._FORM_BIAS[form]  # pylint: disable=protected-access
  shifts = ws._FORM_ASM[form][0]  # pylint: disable=protected-access
  shift = lambda v, n: (v << np.uint32(n)) if n >= 0 else (v >> np.uint32(-n))
  stored = mg.NIBBLE_ORDERS[order]
  for p in range(4):  # the thread's word at 8p; the same nibbles, read for the K positions of thread p
    for part in range(4):
      words = [shift(word, n) for n in shifts] if order == "prmt" else [word >> np.uint32(4 * part)]
      got = _run_ptx(ws.form_asm(form, order).format(hi=part + 4, lo=part), words + rows)
      for half in (0, 1):
        v = int(np.flatnonzero(stored[8 * p:8 * p + 8] == 8 * part + 2 * p + half)[0])  # the nibble holding k
        q = (nib[:, v] ^ 8).astype(np.float64)
        want = {"sub_mul": _bf16((q - z64) * s64), "acc_scale": q - z64, "acc_zero": 128 + q,
                "fma128": _bf16((bias + q) * s64 + _bf16(-(bias + z64) * s64)),
                "fma16": _bf16((bias + q) * s64 + _bf16(-(bias + z64) * s64))}[form]
        np.testing.assert_array_equal(got[half], want, err_msg=f"{form} {order} p {p} part {part} half {half}")


@pytest.mark.parametrize("overlap_steps,form", [(False, None), (True, None), (False, "acc_zero")])
def test_no_races_in_the_interpreter(overlap_steps, form, interpreted):
  """The interpreter's race detector sees no race between the TMA warpgroup, the compute warpgroups and the stores
  (acc_zero: also the streamed x sums, shift nibble order)."""
  x, gs, w = _inputs([3, 0, 9, 1], 0, 128)
  params = plgpu.InterpretGPUParams(detect_races=True)
  wm = ws.to_mgpu_layout(w, nibble_order="shift" if form else "prmt")
  got = interpreted(lambda: ws.int4_grouped_matmul_mgpu_ws(x, wm, gs, interpret=params, block_k=128, num_ctas=2,
                                                           overlap_steps=overlap_steps, dequant_form=form))
  assert not interpret_pallas_call.get_races().races_found
  want = ws.int4_grouped_matmul_mgpu_ws_form_reference(x, wm, gs, form or ("sub_mul" if overlap_steps else "acc_scale"))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def _inputs_k512(nibble_order="shift"):
  """`_inputs([3, 0, 17, 1], 0, 256)` with K padded to 512 (block_k 512 and 4 K groups per step), WS layout."""
  x, gs, w = _inputs([3, 0, 17, 1], 0, 256)
  w = ws.to_mgpu_layout(w, nibble_order=nibble_order)
  w = w._replace(q=jnp.pad(w.q, ((0, 0), (0, 0), (0, 512 - K))),
                 scale=jnp.pad(w.scale, ((0, 0), (0, 2), (0, 0))), zero=jnp.pad(w.zero, ((0, 0), (0, 2), (0, 0))))
  return jnp.pad(x, ((0, 0), (0, 512 - K))), gs, w


@pytest.fixture
def table_in_jnp(monkeypatch):
  """Lowering for CUDA on the CPU: the work table's Triton kernel needs a GPU to lower (its compute capability), so
  the lowering tests take the table's jnp reference (`test_int4_ws_work_table` checks the kernel against it)."""
  monkeypatch.setattr(wt, "work_table", wt.work_table_reference)


@pytest.mark.parametrize("cfg", [dict(dequant="ptx", block_k=512, block_r=16), dict(dequant="jnp"),
                                 dict(dequant="ptx", num_compute_wgs=3, overlap_steps=True),
                                 *[dict(dequant="ptx", block_k=512, dequant_form=f) for f in ws.DEQUANT_FORMS[1:]],
                                 dict(dequant="jnp", dequant_form="acc_scale", block_r=16),
                                 *[dict(dequant="ptx", nibble_order="shift", dequant_form=f, **c)
                                   for f in ("sub_mul", "fma128", "acc_scale", "acc_zero")
                                   for c in (dict(block_k=512), dict(num_compute_wgs=3, block_k=256, block_r=16))],
                                 dict(dequant="ptx", block_k=512, dequant_form="acc_zero", block_r=16),
                                 *[dict(dequant="ptx", nibble_order="shift", aligned_tiles=False, block_r=r, **c)
                                   for r in (8, 16)
                                   for c in (dict(block_k=512), dict(num_compute_wgs=4, block_k=256))],
                                 *[dict(dequant="ptx", nibble_order="shift", block_r=r, num_compute_wgs=c, block_k=256)
                                   for r, c in ((24, 2), (32, 4))],
                                 dict(dequant="ptx", nibble_order="shift", block_k=512, ablate="no_decode")])
def test_gpu_path_lowers(cfg, table_in_jnp):
  """The GPU-only path (setmaxnreg, fragment reinterpretation, PTX dequant, wgmma from registers) lowers."""
  cfg = dict(cfg)
  x, gs, w = _inputs_k512(cfg.pop("nibble_order", "prmt"))  # the sixth session's configs: prmt
  f = jax.jit(lambda a, w, g: ws.int4_grouped_matmul_mgpu_ws(a, w, g, num_ctas=132, **cfg))
  text = f.trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("c,memory,want", [(1, 40, 256), (2, 40, 232), (3, 40, 152), (4, 32, 112), (4, 24, 112),
                                           (4, 40, 104)])
def test_register_split_fits_the_launch(c, memory, want):
  """The compute warpgroups' setmaxnreg count: jax's own split where it fits (C <= 3), what the launch holds at C = 4
  (ptxas gives 640 threads 96 registers each), and never more than the launch allocation."""
  got = ws.register_split(c, memory)
  assert got == want
  launch = min(255, 65536 // (128 * (c + 1))) // 8 * 8
  assert c * got + memory <= (c + 1) * launch
  with pytest.raises(ValueError, match="deadlock"):
    ws.register_split(c, memory, got + 8) if got < 256 else ws.register_split(c, memory, 264)


@pytest.mark.parametrize("e,n,m,want", [(64, 2048, 64, 4), (64, 2048, 512, 4), (64, 2048, 1024, 4), (128, 768, 128, 3),
                                        (128, 768, 2048, 3), (8, 14336, 16, 2), (8, 14336, 128, 3), (4, 320, 8, 2),
                                        (4, 320, 9, 3), (4, 320, 40, 3), (4, 128, 40, 2), (4, 64, 9, 1)])
def test_default_compute_wgs(e, n, m, want):
  """The benchmark shapes' defaults (132 CTAs): C = 3 where 192 divides N, 4 where 256 does and 64 experts' items fill
  the CTAs (512 items: 97%); where neither (8 x 14336: 448 items at C = 4 fill 85%) 3 with 16-row tiles and 2 with
  8-row tiles or where 192 columns do not fit; 1 below N = 128."""
  assert ws.default_compute_wgs(m, e, n, ws.default_block_r(m, e, aligned_tiles=True), 132) == want


@pytest.mark.parametrize("m,e,aligned,want", [(64, 64, True, 8), (128, 64, True, 8), (129, 64, True, 16),
                                              (256, 64, True, 16), (512, 64, True, 16), (512, 64, False, 8),
                                              (513, 64, False, 16), (16, 8, True, 8), (17, 8, True, 16),
                                              (128, 8, True, 16), (1024, 64, True, 16), (1025, 64, True, 32),
                                              (1536, 64, True, 32), (4096, 64, True, 32), (4096, 64, False, 16)])
def test_default_block_r(m, e, aligned, want):
  """Aligned tiles: R = 8 up to 2 rows per expert on average, 16 up to 16, else 32 (chosen under random routing);
  padded tiles: 8 up to 8 rows per expert, else 16."""
  assert ws.default_block_r(m, e, aligned) == want


def test_c4_lowers_with_the_fitting_split(table_in_jnp):
  """C = 4 lowers for CUDA with setmaxnreg 112 (compute) and 32 (TMA), not jax's own 120, which would deadlock."""
  x, gs, w = _inputs([3, 0, 17, 1], 0, 256)
  w = ws.to_mgpu_layout(w)
  f = jax.jit(lambda a, w, g: ws.int4_grouped_matmul_mgpu_ws(a, w, g, num_ctas=132, num_compute_wgs=4, block_k=128))
  text = mosaic_module_text(f.trace(x, w, gs).lower(lowering_platforms=("cuda",)))
  counts = set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32 (\d+)", text))
  assert counts == {"112", "32"}, counts


@pytest.mark.parametrize("depth,waits", [(None, False), (4, False), (2, True)])
def test_wgmma_depth_waits_within_the_step(depth, waits, table_in_jnp):
  """block_k 512 (4 K groups per step) at C = 3: with wgmma_depth 2 the step waits until one wgmma is pending before
  it decodes groups 2 and 3; at the default (all 4 groups) or 4 it waits only at the step's end (wait_group 0)."""
  x, gs, w = _inputs_k512()
  f = jax.jit(lambda a, w, g: ws.int4_grouped_matmul_mgpu_ws(a, w, g, num_ctas=132, num_compute_wgs=3, block_k=512,
                                                             block_r=16, wgmma_depth=depth))
  text = mosaic_module_text(f.trace(x, w, gs).lower(lowering_platforms=("cuda",)))
  assert "wgmma.wait_group.sync.aligned 0;" in text
  assert ("wgmma.wait_group.sync.aligned 1;" in text) == waits


def test_swiglu_gets_the_single_calls_ring(table_in_jnp):
  """The fused call's h buffer does not shrink its TMA ring: at K = 2048 (8 steps of 256) with 32-row tiles and
  C = 3, 4 stages fit the budget for one weight's call, and the fused call gets 4 too (counting h_smem, 12 KB, against
  the budget had given it 2; 9% slower on the H200, results/ws_swiglu_ring.json). The ring shows as the leading
  dimension of the streamed scale tiles, bf16 [steps, 2, 192]."""
  kw, n = 2048, 192

  def weight(key, cols):  # random codes, unit scales: only the shapes matter here
    return ws.to_mgpu_layout(i4.Int4Weights(packed=jax.random.bits(key, (E, kw // 2, cols), jnp.uint8),
                                           scale=jnp.ones((E, kw // G, cols), jnp.bfloat16),
                                           zero=jnp.full((E, kw // G, cols), 8, jnp.uint8)))

  ks = jax.random.split(jax.random.key(5), 2)
  x, gs = jnp.ones((72, kw), jnp.bfloat16), jnp.asarray([18, 18, 18, 18], jnp.int32)  # 18 rows per expert: R = 32

  def ring(w, **kw_):
    f = jax.jit(lambda a, w, g: ws.int4_grouped_matmul_mgpu_ws(a, w, g, num_ctas=132, num_compute_wgs=3, **kw_))
    text = mosaic_module_text(f.trace(x, w, gs).lower(lowering_platforms=("cuda",)))
    return set(re.findall(r"memref<(\d+)x2x192xbf16", text))

  assert ring(weight(ks[0], n)) == {"4"}
  assert ring(gu.interleave_gate_up(weight(ks[0], n // 2), weight(ks[1], n // 2)), swiglu=True) == {"4"}


def test_rejects_bad_arguments():
  x, gs, w = _inputs([1, 2, 3, 4], 0, 128)
  w = ws.to_mgpu_layout(w, nibble_order="prmt")
  with pytest.raises(TypeError, match="bfloat16"):
    ws.int4_grouped_matmul_mgpu_ws(x.astype(jnp.float32), w, gs, interpret=True)
  with pytest.raises(ValueError, match="num_compute_wgs"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, num_compute_wgs=3, interpret=True)  # the N tile 192 exceeds N = 128
  x4, gs4, w4 = _inputs([1, 2, 3, 4], 0, 256)
  with pytest.raises(ValueError, match="deadlock"):  # more than the launch holds: setmaxnreg would wait forever
    ws.int4_grouped_matmul_mgpu_ws(x4, ws.to_mgpu_layout(w4), gs4, num_compute_wgs=4, compute_registers=120,
                                   interpret=True)
  with pytest.raises(ValueError, match="num_compute_wgs"):
    ws.int4_grouped_matmul_mgpu_ws(x4, ws.to_mgpu_layout(w4), gs4, num_compute_wgs=5, interpret=True)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, block_k=128, max_concurrent_steps=3, interpret=True)
  with pytest.raises(ValueError, match="overlap_steps"):  # one slot: the step would wait for its own release
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, block_k=128, max_concurrent_steps=1, overlap_steps=True, interpret=True)
  with pytest.raises(ValueError, match="dequant_form"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, dequant_form="fma", interpret=True)
  with pytest.raises(ValueError, match="block_r"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, block_r=12, interpret=True)
  with pytest.raises(ValueError, match="wgmma_depth"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, wgmma_depth=0, interpret=True)
  with pytest.raises(ValueError, match="wgmma_depth=1 .*'sub_mul'"):  # the per-group waits need per-group accumulators
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, block_k=256, wgmma_depth=1, dequant_form="sub_mul", interpret=True)
  with pytest.raises(ValueError, match="acc_scale"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, block_k=128, overlap_steps=True, dequant_form="acc_scale", interpret=True)
  with pytest.raises(ValueError, match="pad lhs"):
    ws.int4_grouped_matmul_mgpu_ws(x[:, :128], w, gs, interpret=True)
  with pytest.raises(ValueError, match="dequant"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, dequant="lut", interpret=True)
  with pytest.raises(ValueError, match="acc_zero"):
    ws.int4_grouped_matmul_mgpu_ws(x, w, gs, block_k=128, overlap_steps=True, dequant_form="acc_zero", interpret=True)
  _, _, wq = _inputs([1, 2, 3, 4], 0, 128)
  with pytest.raises(ValueError, match="nibble_order"):
    ws.to_mgpu_layout(wq, nibble_order="lop3")
  w_shift = ws.to_mgpu_layout(wq, nibble_order="shift")
  with pytest.raises(ValueError, match="fma16"):  # its nibble at bits 3-6 needs the prmt order
    ws.int4_grouped_matmul_mgpu_ws(x, w_shift, gs, dequant_form="fma16", interpret=True)
  with pytest.raises(TypeError, match="prmt nibble order"):  # the one-warpgroup kernel reads K_ORDER only
    mg.int4_grouped_matmul_mgpu(x, w_shift, gs, interpret=True)
  with pytest.raises(TypeError, match="to_mgpu_layout"):
    ws.int4_grouped_matmul_mgpu_ws(x, tuple(w), gs, interpret=True)
