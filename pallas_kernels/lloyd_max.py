"""Per-channel weighted Lloyd-Max codebooks, every iteration in one Pallas (Triton) kernel.

Math, per channel j with levels c_0 <= ... <= c_{L-1} (samples x [N, H], row weights w [N]):
  thresholds t_l = (c_{l-1} + c_l) / 2, l = 1..L-1; a sample goes to the cell of its nearest level (one on a
  threshold to the lower cell);
  W_l = sum_n w_n [x_nj in cell l],   S_l = sum_n w_n (x_nj - m_j) [x_nj in cell l],   m_j the weighted mean;
  Lloyd-Max:  c_l <- m_j + S_l / W_l (an empty cell keeps its level), then sorted;
  uniform (levels centre + step·z_l, z = (-1.5, -0.5, 0.5, 1.5)): the weighted least-squares (centre, step) of the
  cells' offsets, step <- cov(z, x) / var(z) from the W_l and S_l (kept where var(z) ~ 0 or the fit is not
  positive), centre <- m_j - step·mean(z).
The same iterations as `moe_jax.kv_quant.lloyd` (which works on sorted samples and also returns the distortion).

Kernel: program (head, block of BH channels). Two first passes over the head's samples take the channel means and
the centred samples' sum (~0, but what the cells' sums add up to); each iteration then streams the samples in
blocks of BN rows again and accumulates, per threshold, the weight and the centred sum of the samples at or below
it (2 (L - 1) column sums; the cells' sums are their differences). The levels stay in registers from the first
iteration to the last. One launch for all iterations, where the XLA form is one sort, its prefix sums and ~10 small
kernels an iteration (the OS-KVP refit: 384 heads of 1024 samples per side).

Shapes: N samples, H channels (a multiple of BH), L levels (2, 4 or 8). One head per call; vmap batches heads
(pallas_call's batching adds grid axes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The level offsets of an equally spaced 4-level codebook, in steps about its centre (the uniform form).
UNIFORM_Z = (-1.5, -0.5, 0.5, 1.5)


def sort_columns(cols: list[jax.Array]) -> list[jax.Array]:
  """Odd-even transposition network over L same-shape arrays: elementwise ascending order (min / max only, no sort
  kernel; also `moe_jax.kv_quant.lloyd`'s)."""
  cols = list(cols)
  for r in range(len(cols)):
    for i in range(r % 2, len(cols) - 1, 2):
      cols[i], cols[i + 1] = jnp.minimum(cols[i], cols[i + 1]), jnp.maximum(cols[i], cols[i + 1])
  return cols


def centroid_step(levels: list[jax.Array], w_cell: list[jax.Array], s_cell: list[jax.Array], *,
                  uniform: bool) -> list[jax.Array]:
  """One centroid step from each cell's weight and centred sum, all same-shape arrays (levels centred, ascending).
  Shared by the kernel, its reference and `moe_jax.kv_quant.lloyd`."""
  if not uniform:
    return sort_columns([jnp.where(wc > 0, sc / jnp.maximum(wc, 1e-30), c)
                         for c, wc, sc in zip(levels, w_cell, s_cell)])
  # Two-pass forms over the cells, as weighted moments about mz: all samples in one cell must give vz = 0 exactly
  # (the step kept), not the rounding left by E[z^2] - mz^2.
  tot = jnp.maximum(sum(w_cell), 1e-30)
  mz = sum(z * wc for z, wc in zip(UNIFORM_Z, w_cell)) / tot
  vz = sum((z - mz) ** 2 * wc for z, wc in zip(UNIFORM_Z, w_cell)) / tot
  cov = sum((z - mz) * sc for z, sc in zip(UNIFORM_Z, s_cell)) / tot
  step = levels[1] - levels[0]
  new = jnp.where(vz > 1e-12, cov / jnp.maximum(vz, 1e-12), step)
  new = jnp.where(new > 0, new, step)
  return [new * (z - mz) for z in UNIFORM_Z]


def _update(levels: list[jax.Array], w_le: list[jax.Array], s_le: list[jax.Array], wsum, s_all, *,
            uniform: bool) -> list[jax.Array]:
  """`centroid_step` from the cumulative sums (weight and centred sum at or below each threshold, and of all
  samples), all [BH]. Shared by the kernel and the reference. The centred samples' own sum s_all is ~0, but not to
  the last bit: the top cell is s_all - s_le[-1], not -s_le[-1] (few samples there would carry the whole rounding of
  the mean)."""
  n_levels = len(levels)
  w_cell = [w_le[0]] + [w_le[l] - w_le[l - 1] for l in range(1, n_levels - 1)] + [wsum - w_le[-1]]
  s_cell = [s_le[0]] + [s_le[l] - s_le[l - 1] for l in range(1, n_levels - 1)] + [s_all - s_le[-1]]
  return centroid_step(levels, w_cell, s_cell, uniform=uniform)


def _kernel(x_ref, w_ref, init_ref, o_ref, *, n: int, block_n: int, n_iters: int, uniform: bool):
  # x_ref [N, BH] f32; w_ref [N] f32; init_ref [L, BH] f32; o_ref [L, BH] f32
  n_levels, bh = init_ref.shape
  n_blocks = pl.cdiv(n, block_n)

  def load(i):
    rows = i * block_n + jnp.arange(block_n)
    ok = rows < n
    w = plgpu.load(w_ref.at[pl.ds(i * block_n, block_n)], mask=ok, other=0.0)
    x = plgpu.load(x_ref.at[pl.ds(i * block_n, block_n), :], mask=ok[:, None], other=0.0)
    live = (w > 0)[:, None]
    w = jnp.broadcast_to(jnp.where(live, w[:, None], 0.0), x.shape)
    return jnp.where(live, x, 0.0), w  # [BN, BH] each; zero-weight rows count as 0, whatever x

  def mean_pass(i, carry):
    wsum, s = carry
    x, w = load(i)
    return wsum + jnp.sum(w, axis=0), s + jnp.sum(w * x, axis=0)

  zero = jnp.zeros((bh,), jnp.float32)
  wsum, s = jax.lax.fori_loop(0, n_blocks, mean_pass, (zero, zero))
  mu = s / jnp.maximum(wsum, 1e-30)  # wsum itself unclamped: with no weight at all every cell is empty

  def centred_pass(i, s_all):
    x, w = load(i)
    return s_all + jnp.sum(w * (x - mu[None, :]), axis=0)

  s_all = jax.lax.fori_loop(0, n_blocks, centred_pass, zero)  # ~0, but what the cells' sums add up to

  def iteration(_, levels):
    thr = [0.5 * (levels[l - 1] + levels[l]) for l in range(1, n_levels)]

    def block(i, carry):
      w_le, s_le = carry
      x, w = load(i)
      wx = w * (x - mu[None, :])
      below = [x - mu[None, :] <= t[None, :] for t in thr]
      w_le = [a + jnp.sum(jnp.where(b, w, 0.0), axis=0) for a, b in zip(w_le, below)]
      s_le = [a + jnp.sum(jnp.where(b, wx, 0.0), axis=0) for a, b in zip(s_le, below)]
      return w_le, s_le

    w_le, s_le = jax.lax.fori_loop(0, n_blocks, block, ([zero] * len(thr), [zero] * len(thr)))
    return tuple(_update(list(levels), w_le, s_le, wsum, s_all, uniform=uniform))

  init = tuple(sort_columns([init_ref[l, :] - mu for l in range(n_levels)]))
  levels = jax.lax.fori_loop(0, n_iters, iteration, init)
  for l in range(n_levels):
    o_ref[l, :] = levels[l] + mu


def default_block_h(h: int) -> int:
  """Channels per program: the largest power of two up to 32 that divides H. (8 channels a program at 4096 samples
  was slower on an H100 at 8 heads and far slower at 64: results/oskvp_refit_parts_prefill512_block8_h100_s39.md.)"""
  return min(32, h & -h)


def _check(x, w, init, block_n: int, block_h: int) -> None:
  """Raises ValueError naming the input whose shape or dtype the kernel cannot take."""
  if x.ndim != 2:
    raise ValueError(f"x must be [N, H] (one head; vmap batches heads), got shape {x.shape}")
  n, h = x.shape
  if w.shape != (n,):
    raise ValueError(f"w must be [N] = ({n},), got shape {w.shape}")
  if init.ndim != 2 or init.shape[0] != h or init.shape[1] not in (2, 4, 8):
    raise ValueError(f"init must be [H, L] = ({h}, 2, 4 or 8), got shape {init.shape}")
  if block_h < 1 or block_h & (block_h - 1) or h % block_h:
    raise ValueError(f"block_h = {block_h} must be a power of two dividing x's H = {h}")
  if block_n < 1 or block_n & (block_n - 1):
    raise ValueError(f"block_n = {block_n} must be a power of two")
  for name, a in (("x", x), ("w", w), ("init", init)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {a.dtype}")


@functools.partial(jax.jit, static_argnames=("n_iters", "uniform", "block_n", "block_h", "interpret"))
def _pallas(x, w, init, *, n_iters: int, uniform: bool, block_n: int, block_h: int, interpret: bool):
  """x [N, H], w [N], init [H, L] -> levels f32 [H, L]: one program per block_h channels (grid [H / block_h])."""
  n, h = x.shape
  n_levels = init.shape[1]
  out = pl.pallas_call(
      functools.partial(_kernel, n=n, block_n=block_n, n_iters=n_iters, uniform=uniform),
      grid=(h // block_h,),
      in_specs=[pl.BlockSpec((n, block_h), lambda j: (0, j)), pl.BlockSpec((n,), lambda j: (0,)),
                pl.BlockSpec((n_levels, block_h), lambda j: (0, j))],
      out_specs=pl.BlockSpec((n_levels, block_h), lambda j: (0, j)),
      out_shape=jax.ShapeDtypeStruct((n_levels, h), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="lloyd_max",
  )(x.astype(jnp.float32), w.astype(jnp.float32), init.astype(jnp.float32).T)
  return out.T


def lloyd_max(x: jax.Array, w: jax.Array, init: jax.Array, n_iters: int, *, uniform: bool = False,
              implementation: str = "pallas", block_n: int = 64, block_h: int | None = None,
              interpret: bool = False) -> jax.Array:
  """Per-channel weighted Lloyd-Max (or, with `uniform`, equally spaced 4-level) codebooks of one head.

  Args:
    x: f32 [N, H] samples (H a multiple of block_h); w: f32 [N] row weights (0 or less, or NaN, leaves a row out,
      whatever its values; a cell's weight is a difference of running sums, exact for 0/1 weights, less so for
      weights of very different magnitudes); init: f32 [H, L] starting levels, L 2, 4 or 8 (uniform: L = 4, equally
      spaced).
    n_iters: iterations.
    implementation: "pallas" (the kernel; `interpret=True` runs it on the CPU) or "xla" (the reference).
    block_n, block_h: samples per streamed block and channels per program (powers of two; block_h None:
      `default_block_h`).

  Returns:
    levels f32 [H, L], ascending.
  """
  if block_h is None and x.ndim == 2:
    block_h = default_block_h(x.shape[1])
  _check(x, w, init, block_n, block_h)
  if uniform and init.shape[1] != len(UNIFORM_Z):
    raise ValueError(f"uniform=True needs init of {len(UNIFORM_Z)} levels, got {init.shape[1]}")
  if not isinstance(n_iters, (int, np.integer)) or isinstance(n_iters, bool) or n_iters < 0:
    raise ValueError(f"n_iters={n_iters!r} must be an int >= 0")
  if implementation not in ("pallas", "xla"):
    raise ValueError(f"implementation={implementation!r} must be 'pallas' or 'xla'")
  if implementation == "xla" or x.shape[0] == 0:  # no samples: the reference keeps the starting levels
    return lloyd_max_reference(x, w, init, n_iters, uniform=uniform)
  return _pallas(x, w, init, n_iters=n_iters, uniform=uniform, block_n=block_n, block_h=block_h,
                 interpret=interpret)


def lloyd_max_reference(x: jax.Array, w: jax.Array, init: jax.Array, n_iters: int, *,
                        uniform: bool = False) -> jax.Array:
  """The same iterations in plain jnp, one pass over the samples per iteration. Arguments as `lloyd_max`."""
  x, w = x.astype(jnp.float32), w.astype(jnp.float32)
  live = w > 0
  x = jnp.where(live[:, None], x, 0.0)
  w = jnp.where(live, w, 0.0)
  wsum = jnp.sum(w)
  mu = w @ x / jnp.maximum(wsum, 1e-30)  # [H]
  xc = x - mu

  def iteration(levels, _):
    levels = list(levels)
    thr = [0.5 * (levels[l - 1] + levels[l]) for l in range(1, len(levels))]
    below = [xc <= t[None, :] for t in thr]  # [N, H] each
    w_le = [w @ b.astype(jnp.float32) for b in below]
    s_le = [jnp.sum(jnp.where(b, w[:, None] * xc, 0.0), axis=0) for b in below]
    return tuple(_update(levels, w_le, s_le, wsum, w @ xc, uniform=uniform)), None

  init = tuple(sort_columns([c - mu for c in init.astype(jnp.float32).T]))
  levels, _ = jax.lax.scan(iteration, init, None, length=n_iters)
  return jnp.stack(levels, axis=-1) + mu[:, None]
