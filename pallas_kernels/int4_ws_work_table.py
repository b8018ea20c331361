"""The work table of the warp-specialized int4 kernel in one small Pallas (Triton) kernel, and its jnp reference.

`int4_grouped_matmul_mgpu_ws` deals the work items (row tile, N tile) that hold rows round-robin to its persistent
CTAs: table int32 [n_ctas, I, 8], row i of CTA c = item w = c + i·n_ctas, w = t·n_tiles + j for row tile t and N
tile j. Row tiles of expert e's rows [start_e, start_e + size_e), then of the virtual expert E's (the rows past
sum(group_sizes), which store zeros); a tile loads a window of W rows of lhs that starts at a multiple of 8 (TMA into
8-row-tiled shared memory) and the kernel's wgmma multiplies all W:
- padded (the first form): tiles of R = block_r rows from start_e on, each loading the W = R + 8 rows from the
  multiple of 8 at or before its first row (clipped to M' - W);
- aligned (`aligned=True`): tile u loads rows [8·floor(start_e / 8) + u·R, ... + R), W = R, and holds the expert's
  rows among them: ceil((start_e mod 8 + size_e) / R) tiles, at most one more than padded, each with 8 fewer rows
  in its window (1 row per expert: one tile of 8 instead of 16; 8 or 16 rows starting at a multiple of 8: one tile
  of 8 or 16 instead of 16 or 24).
Columns: expert to stream (E clamped to E - 1), N tile, first loaded row, first row, row count, 1 for the virtual
expert, the CTA's item count (every row), 0. Rows past a CTA's count are zeros and never read.

The table depends on group_sizes only, so it is computed on the device in the call. Built from `row_tiles` (a
search, gathers, concatenations) XLA ran it as 23 small kernels, 26.6 µs of a 120.7 µs call at 64 × 4096→2048 on
the H200; as masked sums (`work_table_reference`) 4-5 kernels, 5.4-6.8 µs (results/kernel_breakdown*.md). `work_table`
is one Pallas kernel: each program computes the experts' prefix sums (scans over Ep = E rounded up to a power of two,
or, `prefix="masked"`, the first form, masked sums over [Ep, Ep]) and picks the expert of its `block` items by a
one-hot sum over [block, Ep]. On the H200 (thirteenth session, results/kernel_breakdown_scan.md) the defaults (scan,
16 rows per program) took 1.3 / 1.7 / 2.3 µs at E = 8 / 64 / 128, against 1.9 / 4.3 / 10.0 µs for the masked form
with 64 rows per program (whose Ep² prefix and [64, 128] picks made the int4 call 0.013 ms slower than the XLA
table at E = 128) and 5.4 / 5.5 / 6.8 µs for the XLA table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

COLUMNS = 8
NITEMS = 6  # the column of the CTA's item count


def window(block_r: int, aligned: bool) -> int:
  """W, the rows of lhs a tile loads: R + 8 for padded tiles, R for aligned ones (module docstring)."""
  return block_r if aligned else block_r + 8


def loaded_rows(m: int, block_r: int, aligned: bool) -> int:
  """M', the rows of lhs padded for the kernel's loads: M rounded up to a multiple of 8 (TMA's 8-row tiles), at
  least one window."""
  return max(m + (-m % 8), window(block_r, aligned))


def _max_tiles(m: int, n_experts: int, block_r: int, aligned: bool) -> int:
  """T_max, the most row tiles any group sizes give: ceil(M / R) + E + 1 (an aligned expert's offset adds one more
  tile each: + 2 (E + 1))."""
  return -(-m // block_r) + (2 if aligned else 1) * (n_experts + 1)


def table_rows(m: int, n_experts: int, *, block_r: int, n_tiles: int, n_ctas: int, aligned: bool = False) -> int:
  """I, the table's rows per CTA: enough for every possible item (T_max row tiles × n_tiles)."""
  return -(-_max_tiles(m, n_experts, block_r, aligned) * n_tiles // n_ctas)


def _items(w, tile_start, tile_end, starts, ends, ids, total, total_tiles, *, m, m_loaded, block_r, n_tiles, t_max,
           n_experts, aligned):
  """The columns 0..5 of items w (int32 [P]) from the experts' prefix sums ([Ep] each, experts past E empty)."""
  e = n_experts
  t = jnp.minimum(w // n_tiles, t_max - 1)  # [P] row tile of each item
  hit = (tile_start[None, :] <= t[:, None]) & (t[:, None] < tile_end[None, :])  # [P, Ep]: one expert at most
  pick = lambda v: jnp.sum(jnp.where(hit, v[None, :], 0), axis=1)
  v_size = jnp.maximum(m - total, 0)  # the virtual expert E: rows past the groups
  v_tiles = _tiles(total, v_size, block_r, aligned)
  virtual = (t >= total_tiles) & (t < total_tiles + v_tiles)
  found = pick(jnp.ones_like(ids)) > 0
  valid = found | virtual
  expert = jnp.where(virtual, e - 1, pick(ids))
  end = jnp.where(virtual, total + v_size, pick(ends))
  if aligned:  # tile u of an expert loads rows [8·floor(start / 8) + u·R, ... + R)
    base = t * block_r + jnp.where(virtual, total // 8 * 8 - total_tiles * block_r,
                                   pick(starts // 8 * 8 - tile_start * block_r))
    first = jnp.maximum(base, jnp.where(virtual, total, pick(starts)))
    count = jnp.clip(jnp.minimum(end, base + block_r) - first, 0, block_r)
    loaded = jnp.clip(base, 0, m_loaded - block_r)
  else:  # tile u holds rows start + u·R ... + R; its window starts at the multiple of 8 at or before them
    first = t * block_r + jnp.where(virtual, total - total_tiles * block_r, pick(starts - tile_start * block_r))
    count = jnp.clip(end - first, 0, block_r)
    loaded = jnp.clip(first // 8 * 8, 0, m_loaded - block_r - 8)
  cols = (expert, w % n_tiles, loaded, first, count, virtual.astype(jnp.int32))
  return [jnp.where(valid, c, 0) for c in cols], (total_tiles + v_tiles) * n_tiles


def _tiles(starts, sizes, block_r, aligned):
  """Row tiles of experts with these starts and sizes: ceil(size / R), or aligned ceil((start mod 8 + size) / R)."""
  if aligned:
    return jnp.where(sizes > 0, (starts % 8 + sizes + block_r - 1) // block_r, 0)
  return (sizes + block_r - 1) // block_r


def _prefix(sizes, ids, block_r, m, scan: bool = False, aligned: bool = False):
  """Start and end ([Ep] each) of the experts' rows and row tiles, and their totals: inclusive prefix sums as masked
  sums over [Ep, Ep], or as scans (`jnp.cumsum`, which Triton lowers to one tt.scan) when `scan`. A negative size
  counts as 0 and the rows stop at M (group_sizes cannot be checked under jit; sizes summing past M made tiles store
  past the output and read shared memory out of range)."""
  cumsum = jnp.cumsum if scan else (
      lambda v: jnp.sum(jnp.where(ids[:, None] >= ids[None, :], v[None, :], 0), axis=1))
  sizes = jnp.maximum(sizes, 0)
  inclusive = cumsum(sizes)
  ends, starts = jnp.minimum(inclusive, m), jnp.minimum(inclusive - sizes, m)
  sizes = ends - starts
  tiles = _tiles(starts, sizes, block_r, aligned)
  tile_end = cumsum(tiles)
  return starts, ends, tile_end - tiles, tile_end, jnp.sum(sizes), jnp.sum(tiles)


@functools.partial(jax.jit, static_argnames=("m", "m_loaded", "block_r", "n_tiles", "n_experts", "n_ctas", "aligned"))
def work_table_reference(group_sizes: jax.Array, m: int, m_loaded: int, *, block_r: int, n_tiles: int,
                         n_experts: int, n_ctas: int, aligned: bool = False) -> jax.Array:
  """group_sizes int32 [E] -> the table int32 [n_ctas, I, 8] in jnp (masked sums: no search, gather or
  concatenation)."""
  ids = jnp.arange(n_experts, dtype=jnp.int32)
  starts, ends, tile_start, tile_end, total, total_tiles = _prefix(group_sizes.astype(jnp.int32), ids, block_r, m,
                                                                   aligned=aligned)
  per_cta = table_rows(m, n_experts, block_r=block_r, n_tiles=n_tiles, n_ctas=n_ctas, aligned=aligned)
  w = (jnp.arange(n_ctas, dtype=jnp.int32)[:, None] + jnp.arange(per_cta, dtype=jnp.int32)[None, :] * n_ctas)
  cols, n_items = _items(w.reshape(-1), tile_start, tile_end, starts, ends, ids, total, total_tiles, m=m,
                         m_loaded=m_loaded, block_r=block_r, n_tiles=n_tiles, n_experts=n_experts,
                         t_max=_max_tiles(m, n_experts, block_r, aligned), aligned=aligned)
  cta_items = jnp.maximum(n_items - jnp.arange(n_ctas, dtype=jnp.int32) + n_ctas - 1, 0) // n_ctas  # [C]
  return jnp.stack([*(c.reshape(w.shape) for c in cols), jnp.broadcast_to(cta_items[:, None], w.shape),
                    jnp.zeros_like(w)], axis=-1)


def _kernel(gs_ref, out_ref, *, n_experts: int, ep: int, block: int, per_cta: int, n_ctas: int, prefix: str, **kw):
  # gs_ref int32 [E]; out_ref int32 [n_ctas · I, 8] (flat rows p = c · I + i).
  ids = jnp.arange(ep, dtype=jnp.int32)
  sizes = plgpu.load(gs_ref.at[pl.ds(0, ep)], mask=ids < n_experts, other=0)
  starts, ends, tile_start, tile_end, total, total_tiles = _prefix(sizes, ids, kw["block_r"], kw["m"],
                                                                   prefix == "scan", kw["aligned"])
  p = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)  # [block] flat rows
  c = p // per_cta
  w = c + (p % per_cta) * n_ctas
  cols, n_items = _items(w, tile_start, tile_end, starts, ends, ids, total, total_tiles, n_experts=n_experts, **kw)
  cols += [jnp.maximum(n_items - c + n_ctas - 1, 0) // n_ctas, jnp.zeros_like(w)]
  col = jnp.arange(COLUMNS, dtype=jnp.int32)[None, :]
  tile = sum(jnp.where(col == k, v[:, None], 0) for k, v in enumerate(cols))  # [block, 8]
  plgpu.store(out_ref.at[pl.ds(pl.program_id(0) * block, block), :], tile,
              mask=(p < n_ctas * per_cta)[:, None] & (col >= 0))


PREFIXES = ("masked", "scan")


@functools.partial(jax.jit, static_argnames=("m", "m_loaded", "block_r", "n_tiles", "n_experts", "n_ctas",
                                             "interpret", "prefix", "block", "aligned"))
def work_table(group_sizes: jax.Array, m: int, m_loaded: int, *, block_r: int, n_tiles: int, n_experts: int,
               n_ctas: int, interpret: bool = False, prefix: str = "scan", block: int = 16,
               aligned: bool = False) -> jax.Array:
  """group_sizes int32 [E] -> the table int32 [n_ctas, I, 8] (module docstring), one Pallas kernel.

  Args:
    group_sizes: int32 [E], rows per expert (rows sorted by expert).
    m: rows of lhs; m_loaded: rows of the padded lhs the kernel loads from (M' >= M, >= R + 8).
    block_r: rows per row tile (R); n_tiles: N tiles; n_experts: E; n_ctas: the persistent grid.
    interpret: Pallas interpret mode (CPU).
    aligned: aligned row tiles with R-row windows instead of padded ones with R + 8 (module docstring).
    prefix: how each program computes the experts' prefix sums, one of PREFIXES: "scan" (`jnp.cumsum`, the
      default) or "masked" (sums over [Ep, Ep]); the same values.
    block: table rows per program (a power of two, at least 16): each program picks its items' experts over
      [block, Ep]. 16 (the default) was the fastest of 16-64 at every E on the H200.
  """
  if group_sizes.shape != (n_experts,):
    raise ValueError(f"group_sizes {group_sizes.shape} must be [n_experts={n_experts}]")
  if prefix not in PREFIXES:
    raise ValueError(f"prefix={prefix!r} must be one of {PREFIXES}")
  if block < 16 or block & (block - 1):
    raise ValueError(f"block={block} must be a power of two, at least 16")
  if m_loaded < window(block_r, aligned) or m_loaded % 8:
    raise ValueError(f"m_loaded={m_loaded} must be a multiple of 8 and at least the window, "
                     f"{window(block_r, aligned)} rows")
  per_cta = table_rows(m, n_experts, block_r=block_r, n_tiles=n_tiles, n_ctas=n_ctas, aligned=aligned)
  ep = max(pl.next_power_of_2(n_experts), 16)
  rows = n_ctas * per_cta
  kernel = functools.partial(_kernel, n_experts=n_experts, ep=ep, block=block, per_cta=per_cta, n_ctas=n_ctas,
                             prefix=prefix,
                             m=m, m_loaded=m_loaded, block_r=block_r, n_tiles=n_tiles, aligned=aligned,
                             t_max=_max_tiles(m, n_experts, block_r, aligned))
  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, COLUMNS), jnp.int32), grid=(-(-rows // block),),
                       interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                       name="int4_ws_work_table")(group_sizes.astype(jnp.int32))
  return out.reshape(n_ctas, per_cta, COLUMNS)
