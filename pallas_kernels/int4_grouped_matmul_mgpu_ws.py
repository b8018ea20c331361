"""Grouped (ragged) int4 matmul in Mosaic GPU, warp-specialized: one TMA warpgroup, C compute warpgroups, persistent.

Same contract and weight layout as `int4_grouped_matmul_mgpu` (read its docstring first):
out[m] = lhs[m] @ W[e(m)] for the rows m of expert e (rows sorted by expert), rows past sum(group_sizes) zero, with

  W[e, k, n] = (c[e, n, k] - z'[e, k // 128, n]) · s[e, k // 128, n],   `MgpuInt4Weights` (c = q - 8, z' = z - 8).

By default (`dequant_form="acc_scale"`) W is not rounded to bf16: the wgmma A operand is the exact q - z and each K
group's scale multiplies that group's float32 accumulator, so the result is float32 dequantization's (max rel. error
~3e-6 on the H200) and differs from the bf16-weight reference of the other int4 kernels by that reference's own
rounding (~1.6e-3 of the largest output at K = 4096). `dequant_form="sub_mul"` gives the bf16 weight of
`int4_grouped_matmul_mgpu` exactly; the fma forms fold zero point and scale into one bf16x2 fma (`DEQUANT_FORMS`).

The weight comes in either nibble order of `int4_grouped_matmul_mgpu`: K_ORDER (`MgpuInt4Weights`: a prmt and a lop3
per weight pair, one shift per 8 weights) or K_ORDER_SHIFT (`MgpuInt4WeightsShift`: the pair's nibbles are 16 bits
apart in the word, so a shift by 4·c and one lop3 per pair, no prmt; Marlin's interleave). This module's
`to_mgpu_layout` packs the shift order by default (same values; 559 instead of 623 SASS instructions per compute
thread per 256 weights at block_k 512, and 2.5-6% faster at C = 2 on the H200).

What differs (the "next step" of benchmarks/notes_expert_matmul.md):
- **Warp specialization** (`plgpu.emit_pipeline_warp_specialized`): a CTA has C + 1 warpgroups. The last one only
  issues TMA (weight tile int4 [C·64, block_k], x window bf16 [W, block_k], scale and zero point bf16
  [block_k / 128, C·64]) into a `max_concurrent_steps`-deep ring and gives its registers away (`setmaxnreg`); the C
  compute warpgroups share each x tile and each owns 64 columns of the CTA's N tile, so the x shared memory per weight
  is 1/C of the one-warpgroup kernel's, and one warpgroup's decode runs while another's wgmma does. Each compute
  warpgroup decodes its [64, 128] int4 slice per K group as the one-warpgroup kernel (4X-upcast load, registers
  reinterpreted thanks to `K_ORDER`, PTX dequant in the chosen form) and issues the wgmma from registers; a step waits
  for its wgmmas before it releases the ring slot (and before the next step's decode reuses the registers).
- **Persistent, bubble-free**: the grid is one CTA per SM. XLA lists the work items (row tile, N tile) that hold
  rows and deals them round-robin to the CTAs ([C_ctas, I, 8] table). A CTA runs one pipeline per item, chained with
  the pipeline's START / STEADY / STOP states, so the TMA warpgroup already streams the next item's tiles while the
  compute warpgroups finish the current one and store it (the one-warpgroup kernel refills its ring per program).
- Scale and zero point are streamed with the weight tiles (per step) instead of loaded per program up front.

Rows and the output: a row tile holds up to R (`BLOCK_RS`: 8 to 32) rows of one expert and loads a window of W rows
of lhs that starts at a multiple of 8 (TMA into 8-row-tiled shared memory): by default (`aligned_tiles`) the tiles are
cut at multiples of 8 and W = R; padded tiles (as in `int4_grouped_matmul_mgpu`) take R rows from the expert's first
row and W = R + 8 (`int4_ws_work_table`). Each compute warpgroup writes its out^T [64, W] transposed into shared
memory and stores the tile's rows of out [M, N] with a ladder of power-of-two TMA row stores. Tiles of the virtual
expert E (rows past sum(group_sizes)) stream expert E - 1's weight and store zeros (only when such rows exist).

Measured on the H200 (jax 0.11.2, CUPTI, L2 flushed; results/expert_matmul.md, the issue's grid with the defaults):
2.67-3.16x the best bf16 peer (XLA `ragged_dot`, Mosaic `ragged_dot_mgpu`) and 63-76% of copy bandwidth with every
expert active and <= 16 rows each; the memory side alone (`ablate="no_compute"`) reaches 3.20-3.47x and 71-84% in
the cells below 3x or 70% (results/int4_mgpu_ws_al_abl*.md). At 8 x 4096->14336 the 600 work items of C = 3 leave
the CTAs' last round 55% full, and per CTA the compute sets the pace: with N = 12672 (4 full rounds) the same kernel
is 2.95-3.14x (results/int4_mgpu_ws_al_fill12672.md). Why the defaults are what they are, and what was tried
and left off (overlap_steps: ptxas serializes the wgmmas when one stays in flight across the step loop's back-edge,
C7512; the fma dequant forms; C = 4 with jax's own register split, which deadlocks, hence `register_split`): the
session-by-session record in benchmarks/notes_expert_matmul.md.

Gate/up + SwiGLU (`swiglu=True`): on `int4_gate_up_mgpu.interleave_gate_up(w_gate, w_up)` (columns in blocks of 32,
gate then up) each compute warpgroup's 64 columns hold 32 output columns' gate and up columns; its epilogue reads the
two halves of its out tile back from shared memory and stores silu(gate) · up, [M, F]. On the H200 3.0-3.4x two
matmuls of the best bf16 peer with <= 16 rows per expert, 3-11% faster than two calls
(results/expert_matmul_ws_swiglu.md), and 6-11% faster than two calls plus XLA's silu · up at 16-32 rows per expert
(results/ws_swiglu_ring.json: its h buffer is not counted against the ring's budget, so it gets the single call's
ring).

The persistent pipeline's pieces (register split, ring depth, work table, reading, chaining, multiplying and storing
an item) live in `ws_pipeline.py`, shared with the vq2 kernel (`vq2_grouped_matmul_mgpu_ws`), which replaces only the
int4 decode by codebook look-ups.

CPU interpret mode (`interpret=True`) runs the warp-specialized pipeline (threads, barriers, TMA, wgmma) in Mosaic
GPU's interpreter, with the interpreter-only route of the one-warpgroup kernel: Mosaic relayout, jnp dequant and the
wgmma A operand from shared memory. `setmaxnreg` is a no-op there; the PTX dequant and the register reinterpretation
are checked on the GPU (`benchmarks/int4_mgpu_ws_decode.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int4_gate_up_mgpu as gu
from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import int4_grouped_matmul_mgpu as mg
from pallas_kernels import int4_ws_work_table as wt
from pallas_kernels import ws_pipeline as wp
from pallas_kernels.interpret_settle import settled_when_interpreted

MgpuInt4Weights = mg.MgpuInt4Weights
MgpuInt4WeightsShift = mg.MgpuInt4WeightsShift
register_split = wp.register_split  # this kernel's `register_split`, shared with the vq2 kernel
int4_grouped_matmul_mgpu_ws_reference = mg.int4_grouped_matmul_mgpu_reference
_G = 128
_WG_N = 64  # output columns per compute warpgroup: the M extent of one wgmma
assert _WG_N == 2 * gu.SWIGLU_BLOCK  # swiglu: a warpgroup's columns are one block of gate and one of up
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, W] WGMMA-layout tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
# Columns of the work table.
DEQUANTS = mg.DEQUANTS

# How a K group's zero point and scale reach the weight (`dequant_form`), per pair of weights (one 32-bit register):
# - "sub_mul": 128 + q by prmt + lop3 (magic exponent 0x4300), sub.bf16x2 of 128 + z (exact), mul.bf16x2 by s: one
#   rounding of (q - z) s, the reference's bf16 weight. 4 instructions (+ 1 shift per 8 weights).
# - "fma128": the same 128 + q, then one fma.rn.bf16x2 by s plus c = bf16(-(128 + z) s), precomputed per group and
#   column. 3 instructions. c is rounded to bf16 at |c| ~ 128 s: the weight is off by up to ~s/2 (a systematic error
#   per group and column); ~3.5% max rel. error of the output against the reference at 4096-wide K.
# - "fma16": 1 + q/16 by prmt + lop3 (q in the top 4 mantissa bits, exponent 0x3F80: needs the words shifted left by 3
#   and right by 1 instead of 0 and 4, one more shift per 8 weights), then fma.rn.bf16x2 by 16 s plus
#   c = bf16(-(16 + z) s): the rounded c is smaller, the weight off by up to ~s/16; ~0.7% max rel. error.
# - "acc_scale": q - z (exact, small integers) is the wgmma A operand, each K group's wgmma goes into its own zeroed
#   accumulator and the step adds s · that accumulator (float32 FFMA per accumulator element, W / 2 per thread per
#   group) to the item's accumulator. 3 instructions per pair; no bf16 rounding of the weight at all, so it differs
#   from the reference by the reference's own rounding (~1.5e-3 max rel. at 4096-wide K), and it is exact against
#   float32 dequantization.
# - "acc_zero" (seventh session): the zero point goes to the accumulator too. The wgmma A operand is 128 + q itself
#   (the lop3's output, exact), and the step adds s · (acc_g - (128 + z) · xsum_g) with xsum_g [W] = the sum of each
#   x row over the K group (float32, computed by XLA before the kernel and streamed with the x tile): 2 FFMA per
#   accumulator element and group instead of 1, and no bf16x2 instruction per weight pair. The subtraction cancels
#   128 · xsum, so it is float32 dequantization up to that cancellation (~1e-6 relative to the largest output with
#   zero-mean x, more with a large mean).
DEQUANT_FORMS = ("sub_mul", "fma128", "fma16", "acc_scale", "acc_zero")
# form -> (left shifts of the word that the two prmt operands take (negative: right), lop3 mask, lop3 xor constant,
# the bf16x2 instructions after the lop3, if any). {a}, {b}: the per-row operands of the form (see _row_operands).
_FORM_ASM = {
    "sub_mul": ((0, -4), "0x000F000F", "0x43084308", "sub.bf16x2 t, t, {a};\nmul.bf16x2 $0, t, {b};"),
    "fma128": ((0, -4), "0x000F000F", "0x43084308", "fma.rn.bf16x2 $0, t, {b}, {a};"),
    "fma16": ((3, -1), "0x00780078", "0x3FC03FC0", "fma.rn.bf16x2 $0, t, {b}, {a};"),
    "acc_scale": ((0, -4), "0x000F000F", "0x43084308", "sub.bf16x2 $0, t, {a};"),
    "acc_zero": ((0, -4), "0x000F000F", "0x43084308", ""),
}
# The bias the magic-number conversion adds to q (x = bias + q, up to a power of two): 128 (0x4300 | q), 16 (1 + q/16).
_FORM_BIAS = {"sub_mul": 128, "fma128": 128, "fma16": 16, "acc_scale": 128, "acc_zero": 128}
_ACC_FORMS = ("acc_scale", "acc_zero")  # the forms that scale float32 accumulators per K group
# The nibble orders (`int4_grouped_matmul_mgpu.NIBBLE_ORDERS`): "prmt" (K_ORDER, `MgpuInt4Weights`) takes a prmt per
# pair and one shift per word; "shift" (K_ORDER_SHIFT, `MgpuInt4WeightsShift`) a shift per pair (3 per word) and no
# prmt. fma16's nibble sits at bits 3-6, which the shift order's lop3 cannot reach without one more shift: prmt only.


@functools.partial(jax.jit, static_argnames=("group_size", "nibble_order"))
def to_mgpu_layout(w: i4.Int4Weights, *, group_size: int = _G,
                   nibble_order: str = "shift") -> MgpuInt4Weights | MgpuInt4WeightsShift:
  """`int4_grouped_matmul_mgpu.to_mgpu_layout` with the shift nibble order by default: the layout this kernel decodes
  with a shift and one lop3 per weight pair (no prmt), to the same values; 2.5-6% faster than the K_ORDER layout at
  C = 2 in the seventh session's H200 run. nibble_order="prmt" gives `MgpuInt4Weights`, which the one-warpgroup
  kernel reads too. Jitted; group_size and nibble_order are static."""
  return mg.to_mgpu_layout(w, group_size=group_size, nibble_order=nibble_order)


def _row_operands(form: str, s, z):
  """bf16 [64] scale s and zero point z' = z - 8 of a K group -> the per-row operands ({a}, {b}) of `_FORM_ASM`.

  sub_mul / acc_scale: (128 + z, s); fma128: (bf16(-(128 + z) s), s); fma16: (bf16(-(16 + z) s), 16 s); acc_zero:
  none. Sums of integers below 256 and products by 16 are exact in bf16; the products by s round once.
  """
  zz = z + jnp.bfloat16(_FORM_BIAS[form] + 8)  # bias + z, exact
  if form == "acc_zero":
    return ()
  if form in ("sub_mul", "acc_scale"):
    return zz, s
  return -(zz * s), (s * jnp.bfloat16(16) if form == "fma16" else s)


def form_asm(form: str, order: str = "prmt") -> str:
  """The inline PTX of a dequant form for `int4_grouped_matmul_mgpu.dequant_registers` in a nibble order."""
  _, mask, xor, tail = _FORM_ASM[form]
  n_words = 2 if order == "prmt" else 1  # the operands before the per-row ones
  lines = ["prmt.b32 t, $1, $2, 0xF{hi}F{lo};"] if order == "prmt" else []
  lines.append(f"lop3.b32 {'t' if tail else '$0'}, {'t' if order == 'prmt' else '$1'}, {mask}, {xor}, 0x6A;")
  if tail:
    lines.append(tail.format(a=f"${n_words + 1}", b=f"${n_words + 2}"))
  return "{{\n.reg .b32 t;\n" + "\n".join(lines) + "\n}}"


def _dequant_form_ptx(w, rows, form: str, order: str):
  """int4 [64, G] (4X-upcast layout, stored in `order`) and the form's per-row operands (bf16 [64] each) -> bf16
  [64, G] operand."""
  return mg.dequant_registers(w, *rows, n_rows=_WG_N, asm=form_asm(form, order), shifts=_FORM_ASM[form][0],
                              nibble_order=order)


def _dequant_form_jnp(w, s, z, form: str):
  """Interpret mode's equivalent of `_dequant_form_ptx` on a relaid-out int4 [64, G] tile (c = q - 8): the same bf16
  values (the fused multiply-add of the fma forms is exact in float32 here, then rounded once to bf16)."""
  bcast = lambda v: plgpu.layout_cast(jax.lax.broadcast_in_dim(v, (_WG_N, _G), (0,)), plgpu.Layout.WGMMA)
  x = w.astype(jnp.float32) + float(_FORM_BIAS[form] + 8)  # bias + q
  if form == "acc_zero":
    return x.astype(jnp.bfloat16)  # 128 + q, exact
  a, b = _row_operands(form, s, z)
  if form in ("sub_mul", "acc_scale"):
    d = (x - bcast(a).astype(jnp.float32)).astype(jnp.bfloat16)  # q - z, exact
    return d * bcast(b) if form == "sub_mul" else d
  if form == "fma16":
    x = x / 16.0  # 1 + q/16: b = 16 s
  return (x * bcast(b).astype(jnp.float32) + bcast(a).astype(jnp.float32)).astype(jnp.bfloat16)


def _xsum_window(window: int, gk: int) -> int:
  """Columns of the streamed x-sum tile: W rounded up so that the tile [gk, W'] float32 is a multiple of 128 bytes
  (Mosaic's TMA copies move a number of bytes divisible by the warpgroup size)."""
  return next(w for w in range(window, window + 33, 8) if gk * w * 4 % 128 == 0)


def _kernel(table_ref, lhs_ref, q_ref, scale_ref, zero_ref, *refs, o_smem, a_smem, n_wgs: int, block_k: int,
            block_r: int, window: int, n_groups: int, n_cols: int, steps: int, memory_registers: int,
            compute_registers: int, a_from_smem: bool, ablate: str, dequant: str, overlap_steps: bool,
            dequant_form: str, order: str, wgmma_depth: int, swiglu: bool, h_smem=None):
  # table_ref: int32 [C_ctas, I, 8] (work_table); lhs_ref: bf16 [M', Kp]; q_ref: int4 [E, N, Kp]; scale_ref,
  # zero_ref: bf16 [E, Kg, N]; refs: (xsum_ref float32 [Kg, M'] (acc_zero only: x summed per K group), out_ref
  # float32 [M', N], or [M', N / 2] with swiglu). o_smem: float32 [n_wgs, W, 64] (W = R, or R + 8 with padded tiles),
  # one out tile per compute warpgroup; a_smem: bf16 [n_wgs, 64, G] (interpret mode's route of the decoded tile);
  # h_smem (swiglu): float32 [n_wgs, W, 32], silu(gate) · up of each warpgroup's 32 output columns.
  xsum_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
  cta, wg = jax.lax.axis_index("c"), jax.lax.axis_index("wg")
  bn = n_wgs * _WG_N
  gk = block_k // _G
  xs_window = _xsum_window(window, gk)
  ksteps = n_groups // gk
  wg_rows = pl.ds(pl.multiple_of(jnp.minimum(wg, n_wgs - 1) * _WG_N, _WG_N), _WG_N)  # this warpgroup's N slice

  consumed = []  # overlap_steps: the ring's consumed barriers (one per input, `steps` slots), set below

  def release(slot, predicate=None):
    for bar in consumed:
      plgpu.barrier_arrive(bar.at[slot], predicate=predicate)

  def load_rows(s_smem, z_smem, c):  # bf16 [64] scale and zero point of K group c
    return plgpu.load(s_smem.at[c, wg_rows], layout=_ROW), plgpu.load(z_smem.at[c, wg_rows], layout=_ROW)

  def decode(q_smem, s_smem, z_smem, c, rows=None):
    """K group c of the step: bf16 [64, G], this warpgroup's W^T slice in the form's scale (see DEQUANT_FORMS); rows:
    the group's (scale, zero point), loaded here after the int4 tile when not given."""
    if ablate == "no_decode":  # timing only: no int4 load or dequant; the wgmma multiplies q - z = 1 everywhere
      return plgpu.layout_cast(jnp.full((_WG_N, _G), 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)
    ks = pl.ds(c * _G, _G)
    w = plgpu.load(q_smem.at[wg_rows, ks], layout=plgpu.Layout.WGMMA_UPCAST_4X)  # int4 [64, G]
    s, z = rows or load_rows(s_smem, z_smem, c)
    if dequant == "ptx":
      return _dequant_form_ptx(w, _row_operands(dequant_form, s, z), dequant_form, order)
    if a_from_smem:  # interpret mode: a real relayout; lhs comes with its columns in K_ORDER
      w = plgpu.layout_cast(w, plgpu.Layout.WGMMA)
    else:
      w = mg.as_wgmma_operand(w, _WG_N)
    return _dequant_form_jnp(w, s, z, dequant_form)

  def mma(acc_ref, w, x_smem, c):
    wp.group_wgmma(acc_ref, w, x_smem, c, a_smem.at[wg] if a_from_smem else None)

  def body(idx, q_smem, x_smem, s_smem, z_smem, *rest):
    # q_smem: int4 [bn, block_k]; x_smem: bf16 [W, block_k]; s_smem, z_smem: bf16 [block_k / G, bn]; acc_zero:
    # rest[0] = xs_smem float32 [block_k / G, W'] (W' >= W, `_xsum_window`). rest[-1], the carry: acc_ref float32
    # [64, W], out^T of this warpgroup's columns (acc forms: the float32 [64, W] array itself). With overlap_steps,
    # rest also holds the pipeline's consumed barriers of this step (unused: the step releases the previous step's
    # slot instead).
    carry = rest[-1]
    (k,) = idx
    if ablate == "no_compute":  # timing only: the TMA stream and the ring's barriers, no loads, decode or wgmma
      return carry
    if dequant_form in _ACC_FORMS:
      # All groups' scale rows are read up front: a read after the wgmmas is flagged by the interpreter's race
      # detector (against the TMA warpgroup's refill of the slot).
      rows = [load_rows(s_smem, z_smem, c) for c in range(gk)]
      if dequant_form == "acc_zero":
        xsums = [plgpu.load(rest[0].at[c, pl.ds(0, window)], layout=_COL) for c in range(gk)]  # float32 [W] each

      def groups(*tmps):  # tmps: gk zeroed float32 [64, W] accumulators, one per K group
        for c in range(gk):
          if c >= wgmma_depth:  # group c - depth's wgmma is done: its A registers are free for group c's decode
            plgpu.wgmma_wait(wgmma_depth - 1)
          mma(tmps[c], decode(q_smem, s_smem, z_smem, c, rows[c]), x_smem, c)
        acc = carry
        bcast = lambda v, dim: plgpu.layout_cast(jax.lax.broadcast_in_dim(v, (_WG_N, window), (dim,)),
                                                 plgpu.Layout.WGMMA)
        for c in range(gk):  # reading an accumulator waits for the wgmmas
          s = bcast(rows[c][0].astype(jnp.float32), 0)
          if dequant_form == "acc_zero":  # tmps[c] = sum_k x (128 + q): subtract (128 + z) xsum = (136 + z') xsum
            zz = bcast(rows[c][1].astype(jnp.float32) + 136.0, 0)
            acc = acc + (tmps[c][...] - zz * bcast(xsums[c], 1)) * s  # [64, W]
          else:
            acc = acc + tmps[c][...] * s  # [64, W]
        return acc
      return pl.run_scoped(groups, *[plgpu.ACC((_WG_N, window))] * gk)
    for c in range(gk):
      mma(carry, decode(q_smem, s_smem, z_smem, c), x_smem, c)
      if overlap_steps and c == 0:
        # The previous step's last wgmma ran while this step decoded group 0; once it is done (all but the wgmma
        # just issued), the previous step's ring slot goes back to the TMA warpgroup. Step 0's previous slot was
        # released at the end of the previous item.
        plgpu.wgmma_wait(1)
        release(jax.lax.rem(k + steps - 1, steps), predicate=k > 0)
    if not overlap_steps:
      # The ring slot is released when the body returns, and the next step decodes into the same registers.
      plgpu.wgmma_wait(0)
    return carry

  # The item's N tile is passed as gmem refs sliced at its first column (col0, a multiple of 64), so that the last
  # tile of an N that bn does not divide can start at N - bn (overlapping the tile before it) instead of past N.
  specs = [plgpu.BlockSpec((bn, block_k), lambda k: (0, k), transforms=mg.swizzled(jnp.int4)),
           plgpu.BlockSpec((window, block_k), lambda k: (0, k), transforms=mg.swizzled(jnp.bfloat16)),
           plgpu.BlockSpec((gk, bn), lambda k: (k, 0)),
           plgpu.BlockSpec((gk, bn), lambda k: (k, 0))]
  if xsum_ref is not None:
    specs.append(plgpu.BlockSpec((gk, xs_window), lambda k: (k, 0)))

  def make_pipeline(compute_context, state):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(ksteps,), memory_registers=memory_registers, in_specs=specs, max_concurrent_steps=steps,
        wg_axis="wg", num_compute_wgs=n_wgs, compute_context=compute_context, pipeline_state=state,
        manual_consumed_barriers=overlap_steps)

  def gmem(expert, loaded, col0):
    cols = pl.ds(col0, bn)
    refs = (q_ref.at[expert, cols], lhs_ref.at[pl.ds(loaded, window)], scale_ref.at[expert, :, cols],
            zero_ref.at[expert, :, cols])
    return refs if xsum_ref is None else (*refs, xsum_ref.at[:, pl.ds(loaded, xs_window)])

  ignore = lambda *_, **__: None
  allocs = make_pipeline(ignore, None).get_allocations(*gmem(0, 0, 0))

  def scope(allocs):
    n_items = wp.item_count(table_ref, cta)
    if overlap_steps:
      consumed.extend(allocs["flat_consumed_barrier_refs"])

    @pl.loop(0, n_items)
    def _item(i):
      expert, loaded, first, count, virtual, col0, owner = wp.read_item(table_ref, cta, i, wg, bn, n_cols)

      def compute_context(run):
        def scoped(acc_ref):
          acc = run(acc_ref)[...]  # waits for all wgmmas
          if overlap_steps:  # the last step's slot (ksteps - 1 = steps - 1 mod steps: steps divides ksteps)
            release(steps - 1)
          return acc

        if dequant_form in _ACC_FORMS:  # the carry is the accumulator array itself
          acc = run(plgpu.layout_cast(jnp.zeros((_WG_N, window), jnp.float32), plgpu.Layout.WGMMA))
        else:
          acc = pl.run_scoped(scoped, plgpu.ACC((_WG_N, window)))  # float32 [64, W]
        wp.store_item(acc, o_smem, out_ref, wg=wg, col0=col0, first=first, loaded=loaded, count=count, virtual=virtual,
                   owner=owner, block_r=block_r, window=window, h_smem=h_smem if swiglu else None)

      def run(state):
        make_pipeline(compute_context, state)(*gmem(expert, loaded, col0), allocations=allocs)
      wp.run_chained(i, n_items, run, compute_registers)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scope, allocs, collective_axes="wg")


ABLATIONS = ("", "no_compute", "no_decode")
# How the work table is computed on the GPU (`table_impl`): "pallas" (one Triton kernel, prefix sums by scan),
# "pallas_masked" (its first form: prefix sums as [Ep, Ep] masked sums, 64 rows per program), "xla" (its jnp reference).
TABLE_IMPLS = ("pallas", "pallas_masked", "xla")


def default_compute_wgs(m: int, n_experts: int, n: int, block_r: int, num_ctas: int) -> int:
  """The compute warpgroups per CTA (C) that ran fastest on the H200: 3 where 192 divides N (128 x 2048->768,
  results/int4_mgpu_ws_table.md); else 4 (more compute warps per SM hide more of the decode's latency: 2.83-2.90x the
  best bf16 peer against 2.57-2.62x for C = 2 at 64 x 4096->2048) where 256 divides N and the work items, estimated
  for balanced routing, fill the CTAs' last round to at least 95% (round-robin over num_ctas); else 3 with tiles of
  16 or more rows (the x window costs 4·R / (64·C) of the weight bytes again: at 8 x 4096->14336 x 64 / 128 rows
  C = 3 ran 2.4-3.7% faster than C = 2 under balanced routing, 6.5-8% at 128 rows under random routing and 1% slower
  at 64; results/int4_mgpu_ws_al_c34*.md, _al_c2c3*.md) and 2 with 8-row tiles (C = 2 was 3.6% faster there at 16
  rows, balanced; at 8 x 14336 C = 4's 448 items leave 85% of the last round and it was slower than both under
  balanced routing); 1 where N < 128."""
  if n < 2 * _WG_N:
    return 1
  if n % (3 * _WG_N) == 0:
    return 3
  active = max(min(n_experts, m), 1)
  rows_per_expert = -(-m // active)
  tiles = active * -(-rows_per_expert // block_r)  # row tiles of a balanced routing
  items = tiles * (n // (4 * _WG_N))
  if n % (4 * _WG_N) == 0 and items / (-(-items // num_ctas) * num_ctas) >= 0.95:
    return 4
  return 3 if block_r >= 16 and n >= 3 * _WG_N else 2


BLOCK_RS = (8, 16, 24, 32)  # rows per tile (`block_r`)


def default_block_r(m: int, n_experts: int, aligned_tiles: bool) -> int:
  """Rows per tile R for M rows over E experts. Aligned tiles: 8 up to 2 rows per expert on average, 16 up to 16, else
  32. The rule is chosen for uneven routing, which is what a router gives: an expert with more rows than R, or whose
  rows straddle a multiple of 8 past R, takes two row tiles and streams its weight twice. Measured on the H200 under
  random routing (each row to a uniformly random expert; results/int4_mgpu_ws_al_r8_random_*.md,
  `_al_r24_random*.md`, `_al_r32_big_random.md`, `_al16_2048_random.md`):
  - 1-2 rows per expert: R = 8 beats 16 by 2.5-11% (64 × 4096→2048 × 64 / 128 rows: 0.0594 / 0.0772 ms against
    0.0652 / 0.0871; 128 × 2048→768 × 128; 8 × 4096→14336 × 16);
  - 4 rows per expert: R = 16 beats 8 by 18-20% (0.0876 against 0.1063 ms at 64 × 4096→2048 × 256 rows; 0.0384
    against 0.0480 at 128 × 2048→768 × 512; 0.0822 against 0.1023 at 8 × 4096→14336 × 32); balanced, R = 8 is 4.5%
    faster there (0.0837 against 0.0875), and 5% at 8 rows per expert, where random routing makes it 31% slower;
  - 16 and 24 rows per expert: R = 32 beats 16 by 19% (0.1109 against 0.1368 ms at 64 × 4096→2048 × 1024 rows) and
    24 by 21-24% (0.1337 against 0.1663 at 64 × 4096→2048 × 1536; 0.0543 / 0.0665 at 128 × 2048→768 × 3072;
    0.1156 / 0.1397 at 8 × 4096→14336 × 192); balanced, R = 24 is 5-8% faster than 32 at 24 rows per expert
    (`_al_r24_{2048,768,14336}.md`). Up to 16 rows per expert the rule keeps 16 all the same: with at most 16 rows
    per expert (balanced routing, the issue's target regime) R = 32 is 8-18% slower at 16 and 24% at 8
    (`int4_ws_auto_block_r.md`, `_al_r32_balanced.json`).
  `block_r` overrides the rule where the routing is known. Padded tiles: 8 up to 8 rows per expert, else 16 (the
  earlier rule, `int4_grouped_matmul_mgpu.check_inputs`)."""
  if aligned_tiles:  # (R, the most rows per expert on average it takes)
    return next((r for r, most in ((8, 2), (16, 16)) if m <= most * n_experts), 32)
  return 8 if m <= 8 * n_experts else 16


# The tiling options a caller may fix per weight (`quant.to_mgpu_layout(model, block_r=...)` stores them).
OPTIONS = ("block_r", "num_compute_wgs", "block_k", "aligned_tiles", "table_impl")


def check_options(kp: int, n: int, *, block_r: int | None = None, num_compute_wgs: int | None = None,
                  block_k: int | None = None, aligned_tiles: bool = True, table_impl: str = "pallas") -> None:
  """Raises a ValueError naming the first of OPTIONS that does not fit weights of padded K = kp and N = n (None: the
  kernel's default, always valid)."""
  if block_r is not None and block_r not in BLOCK_RS:
    raise ValueError(f"block_r={block_r} must be one of {BLOCK_RS}")
  if num_compute_wgs is not None and (type(num_compute_wgs) is not int or not 1 <= num_compute_wgs <= 4
                                      or n < _WG_N * num_compute_wgs):
    raise ValueError(f"num_compute_wgs={num_compute_wgs!r} must be 1 to 4 with N = {n} >= 64·num_compute_wgs")
  if block_k is not None and (type(block_k) is not int or block_k <= 0 or block_k % _G or kp % block_k):
    raise ValueError(f"block_k={block_k!r} must be a multiple of {_G} dividing the padded K = {kp}")
  if not isinstance(aligned_tiles, bool):
    raise ValueError(f"aligned_tiles={aligned_tiles!r} must be True or False")
  if table_impl not in TABLE_IMPLS:
    raise ValueError(f"table_impl={table_impl!r} must be one of {TABLE_IMPLS}")


_STATIC = ("num_compute_wgs", "block_k", "block_r", "max_concurrent_steps", "memory_registers", "num_ctas",
           "interpret", "dequant", "overlap_steps", "dequant_form", "compute_registers", "ablate", "table_impl",
           "aligned_tiles", "wgmma_depth", "swiglu")


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=_STATIC)
def int4_grouped_matmul_mgpu_ws(lhs: jax.Array, weights: MgpuInt4Weights | MgpuInt4WeightsShift,
                                group_sizes: jax.Array, *,
                                num_compute_wgs: int | None = None, block_k: int | None = None, block_r: int | None = None,
                                max_concurrent_steps: int | None = None, memory_registers: int | None = None,
                                num_ctas: int | None = None, interpret: bool | plgpu.InterpretGPUParams = False,
                                dequant: str = "ptx", overlap_steps: bool = False,
                                dequant_form: str | None = None, compute_registers: int | None = None,
                                ablate: str = "", table_impl: str = "pallas",
                                aligned_tiles: bool = True, wgmma_depth: int | None = None,
                                swiglu: bool = False) -> jax.Array:
  """lhs bf16 [M, Kp] (rows sorted by expert) @ int4 W [E, Kp, N] per group_sizes int32 [E] -> float32 [M, N].

  Args:
    lhs: bf16 [M, Kp], Kp = the weights' padded K.
    weights: `to_mgpu_layout` of the quantized weight, in either nibble order: `MgpuInt4Weights` (K_ORDER, decoded
      with a prmt per weight pair) or `MgpuInt4WeightsShift` (`nibble_order="shift"`: a shift per pair, no prmt).
    group_sizes: int32 [E], rows per expert; rows past their sum come back zero.
    num_compute_wgs: compute warpgroups per CTA (C, 1 to 4); the CTA's N tile is 64·C columns (N a multiple of 64,
      at least 64·C). Where 64·C does not divide N the last N tile starts at N - 64·C and its warpgroups whose
      columns the tile before holds do not store them. Default `default_compute_wgs`: 3 where 192 divides N, 4 where
      256 does and the work items fill the CTAs, else 3 with row tiles of 16 or more rows and 2 with 8-row tiles
      (the fastest per shape in the H200 runs, results/int4_mgpu_ws_table.md, int4_mgpu_ws_al_c34*.md).
    block_k: K per pipeline step (a multiple of 128 dividing Kp); default 512 for C = 2, 256 for C = 3 and 4 (where
      it divides Kp; the faster per C in the H200 runs).
    block_r: rows per tile R, one of BLOCK_RS (8, 16, 24, 32: the wgmma's N is the window W); default
      `default_block_r`: with aligned tiles 8 up to 2 rows per expert on average, 16 up to 16, else 32 (chosen under
      random routing; its docstring has the measurements), with padded tiles 8 up to 8 rows per expert, else 16.
      Pass it where the routing is known: under balanced routing 8 is 4.5% faster than 16 at 4 rows per expert and
      24 is 5-8% faster than 32 at 24.
    max_concurrent_steps: depth of the TMA ring; must divide Kp / block_k (the chained pipelines need it);
      default the largest of 8, 6, 4, 3, 2 that divides it and fits in shared memory.
    memory_registers: registers per thread of the TMA warpgroup (`setmaxnreg`); default 40 (32 at C = 4).
    compute_registers: registers per thread of each compute warpgroup (`setmaxnreg`); default the most that fit the
      CTA's launch allocation (`register_split`: 232 at C = 2, 152 at C = 3, 112 at C = 4). More is rejected (it
      would deadlock).
    num_ctas: CTAs of the persistent grid; default the device's SM count (4 in interpret mode).
    interpret: run in Mosaic GPU's CPU interpreter (True, or its `InterpretGPUParams`).
    dequant: "ptx" or "jnp", as in `int4_grouped_matmul_mgpu` (interpret mode uses "jnp").
    overlap_steps: let a step's wgmmas run into the next step: the step does not wait for its last wgmma, the next
      step decodes its first K group meanwhile, then waits for it (`wgmma_wait(1)`) and releases the previous
      step's ring slot itself (manual consumed barriers); the item's end waits for all. False: each step waits for
      its wgmmas (`wgmma_wait(0)`) before its slot is released (the earlier behaviour).
    dequant_form: how the zero point and scale reach the weight, one of DEQUANT_FORMS (see there). Default
      "acc_scale": the scale applied per K group to float32 accumulators, no bf16 rounding of the weight (2-6% faster
      than "sub_mul" at <= 8 rows per expert, -1 to +2% at 16, in the sixth session's H200 runs); with overlap_steps,
      which "acc_scale" does not support, "sub_mul" (the reference's bf16 weight). "fma128" / "fma16": one bf16x2 fma
      per weight pair; the rounded per-group constant moves the weight by up to ~s/2 / ~s/16. "acc_zero": the zero
      point on the accumulators too (A = 128 + q; x summed per K group by XLA). Interpret mode reproduces each
      form's values with jnp; `int4_grouped_matmul_mgpu_ws_form_reference` is each form's reference.
    table_impl: how the work table is computed on the GPU (`int4_ws_work_table`), one of TABLE_IMPLS: "pallas"
      (the default: one Triton kernel, 1.3-2.3 µs on the H200 at E = 8-128), "pallas_masked" (its first form, 1.9-10
      µs) or "xla" (its jnp reference, 4-5 small XLA kernels, 5.4-6.8 µs); interpret mode always takes the jnp
      reference.
    aligned_tiles: cut each expert's rows into row tiles aligned to multiples of 8 (`int4_ws_work_table`; the
      default): each tile loads and multiplies a window of W = block_r rows instead of block_r + 8 (False: padded
      tiles, the first form), at the price of at most one more tile per expert (the same count under balanced
      routing). With the default block_r 0-13% faster than padded tiles on the H200 under balanced routing and 2-12%
      under random routing, at no measured cell slower by more than 0.1% (results/int4_mgpu_ws_al*.md).
    wgmma_depth: (acc forms) how many K groups' wgmmas a compute warpgroup keeps in flight within a step: before
      decoding group c >= depth it waits for group c - depth's (`wgmma_wait(depth - 1)`), so only `depth` groups'
      decoded A operands (32 registers each) are live at once. Default all of the step's block_k / 128 groups (no
      wait before the step's end). With block_k 512 at C = 3 (152 registers) a depth of 2 keeps the register use of
      block_k 256 while 3 of the step's 4 decodes run behind a wgmma instead of 1 of 2: 3-6% faster than without on
      the H200, but from tied to 13% slower than the defaults (results/int4_mgpu_ws_al_depth.md), so none uses it.
    swiglu: the fused gate/up + SwiGLU form: `weights` is `int4_gate_up_mgpu.interleave_gate_up(w_gate, w_up)`
      (N = 2F columns, the two weights' columns interleaved in blocks of 32) and the result is float32 [M, F] =
      silu(lhs W_gate) · (lhs W_up): each compute warpgroup's 64 columns are 32 output columns' gate and up columns,
      combined in its epilogue (through shared memory) before the store. One call reads both weights and the x
      windows once per item, and writes F columns instead of 2F.
    ablate: timing experiments only (wrong results): "no_compute" streams every tile through the ring but skips the
      compute warpgroups' loads, decode and wgmmas (the kernel's memory-side ceiling); "no_decode" (acc_scale only)
      keeps the wgmmas, the per-group scaling and the stores but gives every wgmma a constant operand (q - z = 1,
      so out[m, n] = sum_k x[m, k] s[e, k // 128, n]) instead of loading and decoding the int4 tile: with the
      kernel and no_compute it splits the compute's time over the stream into decode and the rest; "" is the kernel.
  """
  dequant, _, (m, kp, e, n) = mg.check_inputs(lhs, weights, dequant, interpret, 8, group_sizes)
  if n % _WG_N:
    raise ValueError(f"N={n} must be a multiple of {_WG_N}")
  check_options(kp, n, block_r=block_r, num_compute_wgs=num_compute_wgs, block_k=block_k,
                aligned_tiles=aligned_tiles, table_impl=table_impl)
  block_r = block_r or default_block_r(m, e, aligned_tiles)
  if ablate not in ABLATIONS:
    raise ValueError(f"ablate={ablate!r} must be one of {ABLATIONS}")
  order = mg.nibble_order(weights)
  num_ctas = num_ctas or (4 if interpret else wp.num_sms())
  num_compute_wgs = num_compute_wgs or default_compute_wgs(m, e, n, block_r, num_ctas)  # fits N (n % 64 == 0)
  bn = num_compute_wgs * _WG_N
  block_k = block_k or next(b for b in ((512, 256, _G) if num_compute_wgs == 2 else (256, _G)) if kp % b == 0)
  ksteps = kp // block_k
  window = wt.window(block_r, aligned_tiles)
  dequant_form = dequant_form or ("sub_mul" if overlap_steps else "acc_scale")
  if ablate == "no_decode" and dequant_form != "acc_scale":
    raise ValueError(f"ablate='no_decode' takes dequant_form='acc_scale', not {dequant_form!r}")
  stage_bytes = (bn * block_k // 2 + window * block_k * 2 + 2 * (block_k // _G) * bn * 2 +
                 (block_k // _G * _xsum_window(window, block_k // _G) * 4 if dequant_form == "acc_zero" else 0))
  # o_smem (and a_smem in interpret mode). swiglu's h_smem (C·W·32·4 bytes, at most 20 KB) sits on top of the
  # budget, so that the fused call gets the single call's ring (at 128 x 2048->768 with 32-row tiles it would
  # otherwise get 2 stages instead of 4); that stays below the H200's 227 KB per CTA.
  fixed = num_compute_wgs * window * _WG_N * 4 + (num_compute_wgs * _WG_N * _G * 2 if interpret else 0)
  max_concurrent_steps = wp.ring_depth(ksteps, stage_bytes, fixed, max_concurrent_steps)
  if dequant_form not in DEQUANT_FORMS:
    raise ValueError(f"dequant_form={dequant_form!r} must be one of {DEQUANT_FORMS}")
  if wgmma_depth is not None and (type(wgmma_depth) is not int or wgmma_depth < 1):
    raise ValueError(f"wgmma_depth={wgmma_depth!r} must be a positive int")
  wgmma_depth = wgmma_depth or block_k // _G
  if wgmma_depth < block_k // _G and dequant_form not in _ACC_FORMS:
    raise ValueError(f"wgmma_depth={wgmma_depth} below the step's {block_k // _G} K groups needs an accumulator form "
                     f"(acc_scale, acc_zero), not dequant_form={dequant_form!r}")
  if overlap_steps and dequant_form in _ACC_FORMS:
    raise ValueError(f"overlap_steps does not combine with dequant_form={dequant_form!r} (each step reads its "
                     "accumulators)")
  if order == "shift" and dequant_form == "fma16":
    raise ValueError("dequant_form='fma16' needs the prmt nibble order (MgpuInt4Weights)")
  if overlap_steps and max_concurrent_steps < 2:  # a step releases the previous step's slot: one slot would deadlock
    raise ValueError(f"overlap_steps needs max_concurrent_steps >= 2, got {max_concurrent_steps}")
  memory_registers = memory_registers or (32 if num_compute_wgs == 4 else 40)
  compute_registers = wp.register_split(num_compute_wgs, memory_registers, compute_registers)
  pad = wt.loaded_rows(m, block_r, aligned_tiles) - m  # TMA reads lhs in 8-row tiles and windows of W rows
  lhs_p = jnp.pad(lhs, ((0, pad), (0, 0))) if pad else lhs
  # acc_zero: x summed per K group (float32 [Kg, M' + W' - W]: zero columns so that the last window's tile fits), in
  # XLA before the kernel.
  xsum = ()
  if dequant_form == "acc_zero":
    xsum = lhs_p.astype(jnp.float32).reshape(m + pad, kp // _G, _G).sum(-1).T
    xsum = (jnp.pad(xsum, ((0, 0), (0, _xsum_window(window, block_k // _G) - window))),)
  if interpret:  # the interpreter's relayout keeps the stored K order: feed lhs in that order too
    lhs_p = lhs_p.reshape(m + pad, -1, 32)[..., mg.NIBBLE_ORDERS[order]].reshape(m + pad, kp)
  table = wp.build_work_table(group_sizes, m, m + pad, table_impl=table_impl, interpret=bool(interpret), block_r=block_r,
                           n_tiles=-(-n // bn), n_experts=e, n_ctas=num_ctas, aligned=aligned_tiles)
  body = functools.partial(_kernel, n_wgs=num_compute_wgs, block_k=block_k, block_r=block_r, window=window,
                           n_groups=kp // _G, n_cols=n, steps=max_concurrent_steps, memory_registers=memory_registers,
                           compute_registers=compute_registers, a_from_smem=bool(interpret), ablate=ablate,
                           dequant=dequant, overlap_steps=overlap_steps, dequant_form=dequant_form, order=order,
                           wgmma_depth=wgmma_depth, swiglu=swiglu)
  scratch = dict(
      o_smem=plgpu.SMEM((num_compute_wgs, window, _WG_N), jnp.float32),
      a_smem=(plgpu.SMEM((num_compute_wgs, _WG_N, _G), jnp.bfloat16, transforms=mg.swizzled(jnp.bfloat16))
              if interpret else plgpu.SMEM((8, 8), jnp.bfloat16)),  # unused on the GPU
      **({"h_smem": plgpu.SMEM((num_compute_wgs, window, gu.SWIGLU_BLOCK), jnp.float32)} if swiglu else {}))
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m + pad, n // 2 if swiglu else n), jnp.float32), grid=(num_ctas,),
      grid_names=("c",),
      num_threads=num_compute_wgs + 1, thread_name="wg", scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **({"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}
         if interpret else {}))
  out = kernel(table, lhs_p, weights.q, weights.scale, weights.zero, *xsum)
  return out[:m] if pad else out


@functools.partial(jax.jit, static_argnames=("dequant_form",))
def int4_grouped_matmul_mgpu_ws_form_reference(lhs: jax.Array, weights: MgpuInt4Weights | MgpuInt4WeightsShift,
                                               group_sizes: jax.Array, dequant_form: str) -> jax.Array:
  """XLA reference of a `dequant_form`: lhs bf16 [M, Kp] @ the form's weight [E, Kp, N] -> float32 [M, N].

  "sub_mul" is `int4_grouped_matmul_mgpu_ws_reference` (bf16 (q - z) s); "fma128" / "fma16" round
  (bias + q) s + bf16(-(bias + z) s) once to bf16, as fma.rn.bf16x2 does; "acc_scale" and "acc_zero" keep (q - z) s
  in float32. Jitted; dequant_form is static.
  """
  if dequant_form not in DEQUANT_FORMS:
    raise ValueError(f"dequant_form={dequant_form!r} must be one of {DEQUANT_FORMS}")
  dtype = jnp.float32 if dequant_form in _ACC_FORMS else jnp.bfloat16
  if dequant_form in ("sub_mul", *_ACC_FORMS):
    w = mg.dequantize_mgpu(weights)  # (q - z) s, exact in float32
  else:
    c, s, z = mg.mgpu_groups(weights)
    bias = float(_FORM_BIAS[dequant_form] + 8)
    # exact before the rounding to bf16
    # reduce_precision, not a bf16 round trip: under jit XLA may drop the round trip (excess precision allowed)
    w = mg.ungroup((c + bias) * s + jax.lax.reduce_precision(-(z + bias) * s, exponent_bits=8, mantissa_bits=7))
  w = w.astype(dtype)  # [E, Kp, N]
  return jax.lax.ragged_dot(lhs.astype(dtype), w, group_sizes, preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST)
