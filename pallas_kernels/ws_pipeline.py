"""The persistent warp-specialized pipeline's pieces shared by the Mosaic GPU grouped matmuls
(`int4_grouped_matmul_mgpu_ws`, `vq2_grouped_matmul_mgpu_ws`): the register split of a CTA's warpgroups, the ring's
depth, the work table (`int4_ws_work_table`) and the per-item steps of a persistent CTA: read an item, chain the
items' pipelines, multiply a K group, store the item's rows.

Each kernel keeps only what differs: its weight's tiles in the ring and their decode into the wgmma operand.
"""

from __future__ import annotations

import contextlib
import math

import jax
from jax._src.pallas.mosaic_gpu import pipeline as _mgpu_pipeline
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int4_gate_up_mgpu as gu
from pallas_kernels import int4_ws_work_table as wt

_G = 128  # the K group: one wgmma K extent
_WG_N = 64  # output columns per compute warpgroup: the M extent of one wgmma
# Shared memory the default ring may use (the H200 allows 227 KB per CTA). The fifth H200 call ran with 220 KB, which
# gives block_k 512 with 8-row tiles at Kp = 4096 a ring of 4 instead of 2: 2-4% slower there, so 200 KB it stays.
SMEM_BUDGET = 200 * 1024


def num_sms() -> int:
  return getattr(jax.devices()[0], "core_count", 0) or 132


def ring_depth(ksteps: int, stage_bytes: int, fixed_bytes: int, requested: int | None = None) -> int:
  """The TMA ring's depth (`max_concurrent_steps`): `requested`, or the largest of 8, 6, 4, 3, 2 that divides the K
  steps (the chained pipelines need it) and fits SMEM_BUDGET with `fixed_bytes` beside the stages (else 1)."""
  if requested is None:
    requested = next((s for s in (8, 6, 4, 3, 2, 1) if ksteps % s == 0 and
                      s * stage_bytes + fixed_bytes <= SMEM_BUDGET), 1)
  if ksteps % requested:
    raise ValueError(f"max_concurrent_steps={requested} must divide Kp / block_k = {ksteps}")
  return requested


def item_count(table_ref, cta):
  """The number of work items of CTA cta (the work table's item-count column)."""
  return table_ref[cta, 0, wt.NITEMS]


def register_split(num_compute_wgs: int, memory_registers: int, compute_registers: int | None = None) -> int:
  """Registers per thread of each compute warpgroup (`setmaxnreg.inc`) that fit the CTA's launch allocation.

  setmaxnreg only moves registers within what the CTA was launched with: ptxas gives each of its
  128 · (C + 1) threads the most registers that fit 65536 (a multiple of 8, at most 255), so C · compute + memory
  must not exceed (C + 1) · launch, or setmaxnreg.inc waits forever (C = 4 hung on the H200 with jax's own split,
  (512 - memory) / C, which assumes 512 per thread slot). Default: the most that fit, a multiple of 8 (232 at C = 2,
  152 at C = 3 with 40 for the TMA warpgroup, as jax's split; 112 at C = 4 with 32).
  """
  if not 1 <= num_compute_wgs <= 4:
    raise ValueError(f"num_compute_wgs={num_compute_wgs} must be 1 to 4")
  if memory_registers % 8 or not 24 <= memory_registers <= 256:
    raise ValueError(f"memory_registers={memory_registers} must be a multiple of 8 in [24, 256] (setmaxnreg)")
  launch = min(255, 65536 // (128 * (num_compute_wgs + 1))) // 8 * 8
  fit = min(256, ((num_compute_wgs + 1) * launch - memory_registers) // num_compute_wgs // 8 * 8)
  compute = fit if compute_registers is None else compute_registers
  if compute % 8 or not 24 <= compute <= fit:
    raise ValueError(f"compute_registers={compute} must be a multiple of 8 in [24, {fit}]: with "
                     f"num_compute_wgs={num_compute_wgs} and memory_registers={memory_registers} more would exceed the "
                     f"launch allocation ({num_compute_wgs + 1} x {launch}) and setmaxnreg would deadlock")
  return compute


@contextlib.contextmanager
def compute_register_count(count: int):
  """Makes `plgpu.emit_pipeline_warp_specialized` (jax 0.11.2) raise its compute warpgroups to `count` registers.

  The pipeline computes the count itself from `memory_registers` as if every thread slot had 512 / 128 registers,
  which C = 4 cannot launch with; it has no argument for it, so its private helper is swapped while the pipeline is
  traced. If a jax upgrade removes the helper, a clear error says so."""
  if not callable(getattr(_mgpu_pipeline, "_compute_registers", None)):
    raise NotImplementedError("this jax's warp-specialized pipeline has no _compute_registers to override; "
                              "the warp-specialized kernels were written for jax 0.11.2")
  original = _mgpu_pipeline._compute_registers  # pylint: disable=protected-access
  _mgpu_pipeline._compute_registers = lambda memory_registers, num_compute_wgs: count  # pylint: disable=protected-access
  try:
    yield
  finally:
    _mgpu_pipeline._compute_registers = original  # pylint: disable=protected-access


def build_work_table(group_sizes: jax.Array, m: int, m_loaded: int, *, table_impl: str, interpret: bool,
                     **table_kw) -> jax.Array:
  """The work table int32 [C_ctas, I, 8] (`int4_ws_work_table`, `table_kw` its static arguments): one Pallas kernel
  on the GPU (`table_impl` "pallas", or "pallas_masked", its first form); the jnp reference with "xla" and in
  interpret mode (the same values, faster in the CPU interpreter)."""
  if interpret or table_impl == "xla":
    return wt.work_table_reference(group_sizes, m, m_loaded, **table_kw)
  if table_impl == "pallas_masked":
    return wt.work_table(group_sizes, m, m_loaded, **table_kw, prefix="masked", block=64)
  return wt.work_table(group_sizes, m, m_loaded, **table_kw)


def read_item(table_ref, cta, i, wg, bn: int, n_cols: int):
  """Item i of CTA cta's row of the work table -> (expert, loaded, first, count, virtual, col0, owner): col0, the
  N tile's first column, is j·bn, or N - bn for a last tile that would cross N; then the warpgroups whose columns the
  previous tile already holds (below j·bn) compute them again but do not store them (owner False)."""
  expert, j, loaded, first, count, virtual = (table_ref[cta, i, col] for col in range(6))
  col0 = pl.multiple_of(jnp.minimum(j * bn, n_cols - bn), _WG_N)
  return expert, pl.multiple_of(loaded, 8), first, count, virtual, col0, col0 + wg * _WG_N >= j * bn


def group_wgmma(acc_ref, w, x_smem, c: int, a_tile=None):
  """acc_ref float32 [64, W] += w bf16 [64, G] (registers) @ the K group c of x_smem bf16 [W, block_k] transposed.
  a_tile: interpret mode's route, bf16 [64, G] shared memory the operand goes through (waited for at once)."""
  ks = pl.ds(c * _G, _G)
  if a_tile is not None:
    a_tile[...] = w
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, a_tile, x_smem.at[:, ks].T)
    plgpu.wgmma_wait(0)
  else:
    plgpu.wgmma(acc_ref, w, x_smem.at[:, ks].T)


def run_chained(i, n_items, run, compute_registers: int):
  """Runs a CTA's item i of n_items as `run(state)` with the pipeline state that chains the items' pipelines (the
  TMA warpgroup then runs `steps` steps ahead across items: START, STEADY, STOP; None for a lone item), the compute
  warpgroups at `compute_registers`."""
  states = ((n_items == 1, None), ((i == 0) & (n_items > 1), plgpu.PipelinePipeline.START),
            ((i > 0) & (i < n_items - 1), plgpu.PipelinePipeline.STEADY),
            ((i > 0) & (i == n_items - 1), plgpu.PipelinePipeline.STOP))
  for pred, state in states:
    @pl.when(pred)
    def _run(state=state):
      with compute_register_count(compute_registers):
        run(state)


def store_item(acc, o_smem, out_ref, *, wg, col0, first, loaded, count, virtual, owner, block_r: int, window: int,
               h_smem=None):
  """A compute warpgroup's epilogue of one work item: its out^T float32 [64, W] (`acc`) transposed into its o_smem
  [W, 64] slot, zeros for a virtual tile, silu(gate) · up with `h_smem` (swiglu), and the tile's `count` rows stored
  to out [M', N] (or [M', N / 2]) from row `first` with a ladder of power-of-two TMA row stores (where `owner`)."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores have read o_smem
  o_smem.at[wg].T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)  # [W, 64]: out rows
  plgpu.commit_smem()

  @pl.when(virtual != 0)
  def _zeros():
    o_smem.at[wg][...] = jnp.zeros((window, _WG_N), jnp.float32)
    plgpu.commit_smem()

  src, cols = o_smem.at[wg], pl.ds(col0 + wg * _WG_N, _WG_N)
  if h_smem is not None:  # the warpgroup's 64 columns are 32 gate columns, then the same 32 output columns' up columns
    half = gu.SWIGLU_BLOCK
    gate, up = src[:, pl.ds(0, half)], src[:, pl.ds(half, half)]  # float32 [W, 32] each
    h_smem.at[wg][...] = gate / (1.0 + jnp.exp(-gate)) * up
    plgpu.commit_smem()
    src, cols = h_smem.at[wg], pl.ds((col0 + wg * _WG_N) // 2, half)
  start, done = first - loaded, jnp.int32(0)
  size = 1 << int(math.log2(block_r))
  while size:  # TMA boxes are static: `count` rows as a ladder of power-of-two row counts
    @pl.when(((count & size) != 0) & owner)
    def _store(size=size, done=done):
      plgpu.copy_smem_to_gmem(src.at[pl.ds(start + done, size)], out_ref.at[pl.ds(first + done, size), cols])
    done = done + (count & size)
    size //= 2
