"""Shared skeleton of the dequant-fused grouped (ragged) matmul kernels: one program per (expert, N tile, K split).

Not a kernel by itself: `int4_grouped_matmul.py` and `vq2_grouped_matmul.py` supply the per-K-group step that reads
their compressed weights and multiplies; this module owns the ragged row handling, which is the same for every format:

  program (e, j, s) covers rows offsets[e] <= m < offsets[e + 1] (offsets = cumsum of group_sizes), output columns
  j·bn <= n < (j + 1)·bn and K split s (split-K: partial sums added by XLA). It walks the expert's rows in blocks
  of `block_m` (masked at the end, zero blocks for an empty expert, so an empty expert costs one launch that reads
  nothing) and, for each row block, the K groups of its split, accumulating in float32 (optionally transposed: the
  tile [bn, bm] of W^T x^T). Rows past sum(group_sizes) are zeroed by the wrapper (`ragged_dot` leaves
  them zero).

Decode is weight streaming: each weight tile is read once per row block, so with <= block_m rows per expert every
compressed byte is read exactly once. Written for the Pallas Triton backend (GPU) and its generic CPU interpret mode.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# step(load_x, weight_refs, e, g, n0, acc) -> acc + the contribution of K group g of expert e to the float32 tile
# ([bm, bn], or [bn, bm] when transposed). load_x(k0, size) -> [bm, size] rows of lhs (masked rows are zero);
# load_x.rowsum(g) -> float32 [bm], the rows' sums over K group g (when ragged_call got group_rowsums).
StepFn = Callable[..., jax.Array]


def check_grouped_args(group_sizes: jax.Array, in_scale: jax.Array | None, e: int, kp: int, what: str) -> None:
  """Raises ValueError naming `group_sizes` unless it is integer [E], or `what`.in_scale unless None or [E, Kp]."""
  if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer array of shape ({e},) (rows per expert), got "
                     f"{group_sizes.dtype} {group_sizes.shape}")
  if in_scale is not None and in_scale.shape != (e, kp):
    raise ValueError(f"{what}.in_scale has shape {in_scale.shape}, expected (E, Kp) = {(e, kp)}")


def check_same_shape(gate: tuple[int, int, int], up: tuple[int, int, int]) -> None:
  """The fused gate/up kernels read both weights with the gate's tiling: (E, Kp, N) must match."""
  if gate != up:
    raise ValueError(f"gate and up weights must have one (E, Kp, N), got {gate} and {up}")


def pow2_at_least(x: int, lo: int) -> int:
  p = lo
  while p < x:
    p *= 2
  return p


def pick_block_m(m: int, n_experts: int, smallest: int = 16) -> int:
  """Rows per block from the static average rows per expert: `smallest` for decode (the narrowest dot side: 16 when
  rows are the M side of the tensor-core tile, 8 when they are its N side), up to 64."""
  return min(64, pow2_at_least(-(-m // max(n_experts, 1)), smallest))


def pick_split_k(m: int, n_experts: int, n_tiles: int, n_groups: int, programs: int = 2 * 132) -> int:
  """K splits so that the (expert, N tile) programs that can have rows (at most min(M, E) experts) reach about
  `programs` (two per H100/H200 multiprocessor): a power of two dividing n_groups that leaves at least 4 K groups
  per split; 1 when there are programs enough."""
  busy = min(m, n_experts) * n_tiles
  split = 1
  while busy * split * 2 <= programs and n_groups % (split * 2) == 0 and n_groups // (split * 2) >= 4:
    split *= 2
  return split


def group_offsets(group_sizes: jax.Array, m: int) -> jax.Array:
  """int32 [E + 1], the first row of each group and M: a negative size counts as 0 and the offsets stop at M, so no
  row outside lhs and the output is read or written whatever group_sizes holds (under jit it cannot be checked;
  ragged_dot leaves such sizes undefined)."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  return jnp.minimum(jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes)]), m)


def check_tiles(block_m: int | None, block_n: int | None) -> None:
  """Raises ValueError naming a tile size Triton cannot take: block_m (None: picked) and block_n powers of two
  >= 8 and >= 16."""
  for name, size, lo in (("block_m", block_m, 8), ("block_n", block_n, 16)):
    if size is not None and (not isinstance(size, int) or size < lo or size & (size - 1)):
      raise ValueError(f"{name}={size!r} must be a power of two >= {lo}")


def pick_block_n(n: int, preferred: int = 128) -> int:
  """The largest power of two <= preferred that divides n (at least 16); preferred checked by `check_tiles`."""
  check_tiles(None, preferred)
  bn = preferred
  while bn > 16 and n % bn:
    bn //= 2
  if n % bn:
    raise ValueError(f"n={n} must be a multiple of 16 for the Pallas grouped matmul")
  return bn


def ragged_call(lhs: jax.Array, group_sizes: jax.Array, weight_sets: Sequence[tuple], step: StepFn, *, n: int,
                n_groups: int, epilogue: Callable[[list[jax.Array]], jax.Array] | None = None,
                out_dtype=jnp.float32, block_m: int | None = None, block_n: int = 128, num_warps: int = 4,
                num_stages: int = 3, interpret: bool = False, poison: float | None = None,
                transposed: bool = False, split_k: int = 1, group_rowsums: jax.Array | None = None) -> jax.Array:
  """Runs `step` over the ragged (expert, row block, N tile, K split, K group) space.

  Args:
    lhs: [M, Kp] rows sorted by expert (Kp = n_groups · group size, already padded).
    group_sizes: int32 [E].
    weight_sets: one tuple of weight arrays per accumulator (two for the fused gate/up variant); every array has the
      experts first.
    step: the format's K-group step.
    n: N, output columns.
    n_groups: K groups per expert.
    epilogue: accumulators (float32 [bm, bn] each) -> output tile; default: the single accumulator.
    out_dtype: output dtype.
    block_m, block_n: tile sizes (block_m default from the average rows per expert).
    num_warps, num_stages: Triton compiler parameters.
    interpret: run the kernel in Pallas' CPU interpret mode.
    poison: if set, the output buffer starts filled with this value (tests use NaN to catch unwritten rows).
    transposed: `step` returns the transposed tile, float32 [bn, bm] (out^T = W^T x^T: the weight is the left
      matmul operand, so the row block is the narrow side of the tensor-core tile); stored transposed.
    split_k: programs per (expert, N tile), each over n_groups / split_k K groups (must divide n_groups). With
      split_k > 1 each writes float32 partial sums [split_k · A, M, N] that XLA adds before the epilogue: more
      programs stream weights in parallel when few (expert, N tile) pairs have rows.
    group_rowsums: optional float32 [n_groups, M], each row's sum over each K group, for steps that fold a zero
      point in after the matmul (`load_x.rowsum(g)`).

  Returns:
    [M, N] in out_dtype; rows past sum(group_sizes) are zero (negative sizes count as 0).
  """
  m, _ = lhs.shape
  e = group_sizes.shape[0]
  check_tiles(block_m, None)  # block_n: by pick_block_n
  bm = block_m or pick_block_m(m, e)
  bn = pick_block_n(n, block_n)
  if split_k < 1 or n_groups % split_k:
    raise ValueError(f"split_k={split_k} must divide the {n_groups} K groups")
  per_split = n_groups // split_k
  offsets = group_offsets(group_sizes, m)
  flat, tree = jax.tree.flatten(list(weight_sets))
  n_acc = len(weight_sets)
  epilogue = epilogue or (lambda accs: accs[0])
  tile = (bn, bm) if transposed else (bm, bn)

  def kernel(offsets_ref, lhs_ref, *refs):
    # offsets_ref: int32 [E + 1]; lhs_ref: [M, Kp]; refs: [group_rowsums float32 [n_groups, M]], weight refs
    # (experts first), then out_ref: [M, N], or float32 [split_k · A, M, N] partial sums when split_k > 1.
    *w_refs, out_ref = refs
    rs_ref = w_refs.pop(0) if group_rowsums is not None else None
    w_sets = jax.tree.unflatten(tree, w_refs)
    ei, j, sk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = offsets_ref[ei], offsets_ref[ei + 1]
    n0 = pl.multiple_of(j * bn, bn)

    def row_block(b, carry):
      r0 = start + b * bm
      rows_ok = (r0 + jnp.arange(bm)) < end  # [bm]

      def load_x(k0, size):
        mask = jnp.broadcast_to(rows_ok[:, None], (bm, size))
        return plgpu.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, size)], mask=mask, other=0)

      if rs_ref is not None:
        load_x.rowsum = lambda g: plgpu.load(rs_ref.at[g, pl.ds(r0, bm)], mask=rows_ok, other=0.0)

      def k_group(g, accs):
        return tuple(step(load_x, ws, ei, g, n0, acc) for acc, ws in zip(accs, w_sets))

      accs = tuple(jnp.zeros(tile, jnp.float32) for _ in w_sets)
      accs = jax.lax.fori_loop(sk * per_split, (sk + 1) * per_split, k_group, accs)
      if transposed:
        accs = tuple(a.T for a in accs)  # [bm, bn]
      mask = jnp.broadcast_to(rows_ok[:, None], (bm, bn))
      if split_k == 1:
        out = epilogue(list(accs)).astype(out_ref.dtype)
        plgpu.store(out_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], out, mask=mask)
      else:
        for a, acc in enumerate(accs):
          plgpu.store(out_ref.at[sk * n_acc + a, pl.ds(r0, bm), pl.ds(n0, bn)], acc, mask=mask)
      return carry

    jax.lax.fori_loop(0, pl.cdiv(end - start, bm), row_block, 0)

  if split_k == 1:
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  else:
    out_shape = jax.ShapeDtypeStruct((split_k * n_acc, m, n), jnp.float32)
  args = [offsets, lhs, *([] if group_rowsums is None else [group_rowsums]), *flat]
  aliases = {}
  if poison is not None:
    args.append(jnp.full(out_shape.shape, poison, out_shape.dtype))
    aliases = {len(args) - 1: 0}
    kernel = _drop_aliased_input(kernel)
  out = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(e, n // bn, split_k), input_output_aliases=aliases, interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      name="ragged_dequant_matmul")(*args)
  if split_k > 1:
    parts = jnp.sum(out.reshape(split_k, n_acc, m, n), axis=0)  # [A, M, N]
    out = epilogue([parts[a] for a in range(n_acc)]).astype(out_dtype)
  total = offsets[-1]
  return jnp.where((jnp.arange(m) < total)[:, None], out, jnp.zeros((), out_dtype))


def _drop_aliased_input(kernel):
  @functools.wraps(kernel)
  def wrapped(*refs):
    *ins, _poisoned_in, out_ref = refs  # The aliased input is the same buffer as out_ref.
    return kernel(*ins, out_ref)
  return wrapped
