"""Per-channel Lloyd-Max codebook fitting on sorted samples (OS-KVP's codebooks, `oskvp.fit`).

A 1-D quantizer's cells are intervals, so on a channel's samples sorted once, a cell is a contiguous run: its
weight, weighted sum and weighted sum of squares are differences of three prefix sums at the run's ends, and the ends
are binary searches of the thresholds (the midpoints between adjacent levels). An iteration is then O(L log N) per
channel instead of O(N L): the N-sample work is one sort and three cumulative sums, done once. A 48-row OS-KVP
fit spent ~11.5 of its ~19 ms of kernels in one-hot per-sample iterations before (H100,
`results/oskvp_refit_parts_b48_kernels_onehot_h100_s39.md`); this form takes 6.0 ms for them, the Pallas kernel
(`pallas_kernels/lloyd_max.py`, `fit_levels(implementation="pallas")`; "auto" on the GPU where
`auto_implementation` says) 1.9.

Samples are centred on their channel's weighted mean before the sums, so an offset common to all samples costs no
precision. What the prefix differences do cost: a cell's sums carry the rounding of the running sums up to it, so
levels far from the mean (a tight cluster 1e4 spreads away) come out ~1e-3 of the spread off the per-sample sums'
(at the same error to ~3e-5), and the distortion history (a cell's c2 - 2 l c1 + l^2 c0) can be off by percent
there; on unimodal channels both agree with per-sample sums to ~1e-6. Weights are best 0/1 (what `oskvp.fit`
passes; exact there) or of similar magnitudes.
Shapes: N samples, H channels, L levels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from moe_jax import backend
from pallas_kernels import lloyd_max as lloyd_max_kernel
from pallas_kernels.lloyd_max import UNIFORM_Z  # equally spaced levels' offsets in steps (`uniform_lloyd`)


@struct.dataclass
class SortedSamples:
  """One channel set's samples sorted per channel, with prefix sums (index i: the first i sorted samples).

  xs f32 [H, N] ascending, centred (rows of weight 0 count as 0); mu f32 [H], the centre; w0, w1, w2 f32 [H, N + 1]:
  prefix sums of w, w·xs and w·xs²; wsum f32 scalar, the total weight (at least 1e-30)."""

  xs: jax.Array
  mu: jax.Array
  w0: jax.Array
  w1: jax.Array
  w2: jax.Array
  wsum: jax.Array


def sort_samples(x: jax.Array, w: jax.Array) -> SortedSamples:
  """x f32 [N, H] samples, w f32 [N] row weights (0 leaves a row out, whatever its values) -> `SortedSamples`."""
  x = x.astype(jnp.float32)
  w = w.astype(jnp.float32)
  w = jnp.where(w > 0, w, 0.0)  # a negative or NaN weight leaves its row out, as in the kernel
  wsum = jnp.maximum(jnp.sum(w), 1e-30)
  live = (w > 0)[:, None]
  xz = jnp.where(live, x, 0.0)
  mu = (w @ xz) / wsum  # [H]
  xs, ws = jax.lax.sort((jnp.where(live, x - mu, 0.0).T, jnp.broadcast_to(w[None, :], xz.T.shape)), num_keys=1)

  def prefix(v):  # [H, N] -> [H, N + 1], 0 first
    return jnp.pad(jnp.cumsum(v, axis=-1), ((0, 0), (1, 0)))

  return SortedSamples(xs=xs, mu=mu, w0=prefix(ws), w1=prefix(ws * xs), w2=prefix(ws * xs * xs), wsum=wsum)


def count_at_most(xs: jax.Array, t: jax.Array) -> jax.Array:
  """xs f32 [H, N] ascending per row, t f32 [H, M] -> int32 [H, M]: how many of row h's values are <= t[h, m]
  (a branch-free binary search: ceil(log2(N + 1)) gathers)."""
  n = xs.shape[-1]
  if n == 0:
    return jnp.zeros(t.shape, jnp.int32)
  top = n.bit_length() - 1

  def halve(i, pos):
    cand = pos + jnp.left_shift(1, top - i)
    probe = jnp.take_along_axis(xs, jnp.minimum(cand, n) - 1, axis=-1)
    return jnp.where((cand <= n) & (probe <= t), cand, pos)

  # Unrolled on the GPU (the form its timings measured: a loop there pays a launch an iteration); a loop on the
  # CPU, where compiling dominates a small fit (2.05 -> 1.6 s for tiny-trained's prefill fit; the eval 13.1 -> 11.1).
  unroll = jax.default_backend() != "cpu"
  return jax.lax.fori_loop(0, top + 1, halve, jnp.zeros(t.shape, jnp.int32), unroll=unroll)


def cell_sums(s: SortedSamples, levels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The nearest-level cells of centred, ascending levels f32 [H, L] (a sample on a threshold goes to the lower cell)
  -> (weight, weighted sum, weighted sum of squares), each f32 [H, L]."""
  thr = 0.5 * (levels[:, 1:] + levels[:, :-1])  # [H, L-1]
  n = s.xs.shape[-1]
  ends = jnp.concatenate([jnp.zeros_like(thr[:, :1], jnp.int32), count_at_most(s.xs, thr),
                          jnp.full_like(thr[:, :1], n, jnp.int32)], axis=-1)  # [H, L+1]

  def between(p):
    v = jnp.take_along_axis(p, ends, axis=-1)
    return v[:, 1:] - v[:, :-1]

  return between(s.w0), between(s.w1), between(s.w2)


def _distortion(s: SortedSamples, levels: jax.Array, sums) -> jax.Array:
  """The weighted mean squared error over all channels of nearest-level quantization with levels [H, L]."""
  c0, c1, c2 = sums
  err = jnp.maximum(c2 - 2.0 * levels * c1 + levels * levels * c0, 0.0)  # per cell; >= 0 up to rounding
  return jnp.sum(err) / (s.wsum * s.xs.shape[0])


def _columns(a: jax.Array) -> list[jax.Array]:
  """[H, L] -> L arrays [H] (the kernel module's per-level form)."""
  return [a[:, i] for i in range(a.shape[-1])]


def _step(s: SortedSamples, levels: jax.Array, uniform: bool) -> tuple[jax.Array, jax.Array]:
  """One iteration on centred, ascending levels [H, L] -> (the next levels [H, L], the distortion of these)."""
  sums = cell_sums(s, levels)
  new = lloyd_max_kernel.centroid_step(_columns(levels), _columns(sums[0]), _columns(sums[1]), uniform=uniform)
  return jnp.stack(new, axis=-1), _distortion(s, levels, sums)


def _iterate(s: SortedSamples, start: jax.Array, n_iters: int, *, uniform: bool) -> tuple[jax.Array, jax.Array]:
  """n_iters `_step`s from start f32 [H, L] (levels less the channels' means s.mu) -> (levels f32 [H, L],
  distortion f32 [n_iters + 1]: before each iteration and after the last)."""
  levels, hist = jax.lax.scan(lambda lv, _: _step(s, lv, uniform), start, None, length=n_iters)
  final = _distortion(s, levels, cell_sums(s, levels))
  return levels + s.mu[:, None], jnp.concatenate([hist, final[None]])


@functools.partial(jax.jit, static_argnames=("n_iters",))
def lloyd_max(x: jax.Array, w: jax.Array, init: jax.Array, n_iters: int) -> tuple[jax.Array, jax.Array]:
  """Per-channel weighted Lloyd-Max iterations.

  Args:
    x: f32 [N, H] samples; w: f32 [N] weights (0 leaves a row out); init: f32 [H, L] starting levels.
    n_iters: iterations.

  Returns:
    (levels f32 [H, L] sorted ascending, distortion f32 [n_iters + 1]): the weighted mean squared error over all
    channels of nearest-level quantization with the levels before each iteration and after the last, from the cells'
    prefix sums (a diagnostic: see the module docstring for its accuracy). Each iteration (centroid step, then
    nearest-level reassignment) cannot increase it, up to that rounding; an empty cell keeps its level.
  """
  s = sort_samples(x, w)
  return _iterate(s, jnp.stack(lloyd_max_kernel.sort_columns(_columns(init - s.mu[:, None])), axis=-1), n_iters,
                  uniform=False)


@functools.partial(jax.jit, static_argnames=("n_iters",))
def uniform_lloyd(x: jax.Array, w: jax.Array, centre: jax.Array, step: jax.Array,
                  n_iters: int) -> tuple[jax.Array, jax.Array]:
  """Per-channel weighted Lloyd iterations for equally spaced 4-level codebooks (levels centre + step·z).

  Alternates nearest-level assignment and the weighted least-squares fit of (centre, step) to the assigned offsets
  z in (-1.5, -0.5, 0.5, 1.5); each half-step minimizes the same squared error, so it cannot increase (up to float32
  rounding). A channel whose samples all fall in one cell, or whose fitted step is not positive, keeps its step.

  Args:
    x: f32 [N, H] samples; w: f32 [N] weights (0 leaves a row out); centre, step: f32 [H] starting values.
    n_iters: iterations.

  Returns:
    (levels f32 [H, 4] ascending, distortion f32 [n_iters + 1]) as in `lloyd_max`.
  """
  s = sort_samples(x, w)
  start = (centre - s.mu)[:, None] + step[:, None] * jnp.asarray(UNIFORM_Z, jnp.float32)[None, :]
  # The least-squares (centre, step) of the cells is the kernel module's `centroid_step` (two-pass moments: samples
  # all in one cell keep their step exactly).
  return _iterate(s, start, n_iters, uniform=True)


def auto_implementation(heads: int, n: int, h: int) -> str:
  """The Lloyd iterations' implementation for "auto": `heads` heads of n samples and h channels at once. On the GPU
  the Pallas kernel (a program per head and 32 channels, streaming all n samples), except where few programs would
  each stream many samples: on an H100, 8 heads of 4096 samples took 1.11 ms in the kernel against 0.85 here, 64
  heads 1.69 against 4.40, 8 heads of 1024 0.48 against 0.51 (results/oskvp_refit_parts_prefill512_*_h100_s39.md,
  ..._pallas_h100_s39.md). So the kernel when there are >= 64 programs or n <= 1024; "xla" off the GPU. Timed at
  4 levels only: with 8 (3-bit codes) the kernel sums 14 columns a block instead of 6, so the crossover may move."""
  if not backend.on_gpu():
    return "xla"
  programs = heads * (h // lloyd_max_kernel.default_block_h(h))
  return "pallas" if programs >= 64 or n <= 1024 else "xla"


def fit_levels(x: jax.Array, w: jax.Array, init: jax.Array, n_iters: int, *, uniform: bool = False,
               implementation: str = "xla", interpret: bool | None = None) -> jax.Array:
  """The levels alone (what `oskvp.fit` keeps): f32 [N, H] samples, [N] weights, [H, L] starting levels (uniform:
  equally spaced, L = 4) -> f32 [H, L] ascending.

  implementation: "xla" (`lloyd_max` / `uniform_lloyd` here, on sorted samples) or "pallas" (all iterations in one
  Triton kernel, `pallas_kernels/lloyd_max.py`), interpreted if `interpret` (None: off the GPU).
  """
  if implementation == "pallas":
    interpret = backend.interpret_kernels() if interpret is None else interpret
    return lloyd_max_kernel.lloyd_max(x, w, init, n_iters, uniform=uniform, interpret=interpret)
  if implementation != "xla":
    raise ValueError(f"implementation={implementation!r} must be 'xla' or 'pallas'")
  if uniform:
    return uniform_lloyd(x, w, jnp.mean(init, axis=-1), init[:, 1] - init[:, 0], n_iters)[0]
  return lloyd_max(x, w, init, n_iters)[0]
