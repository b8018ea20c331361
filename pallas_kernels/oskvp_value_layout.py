"""The two layouts in which the Mosaic GPU OS-KVP cores take the value codes and value outliers.

Per row of the leading axis BK (batch row × kv head), X byte rows a token (the value codes' Q = H/4, or the 8 fp8
outlier channels), S tokens:

  tokens contiguous: [BK, X, S], byte (x, t) at x·S + t. A core's 128-token step reads X rows of 128 bytes, S bytes
    apart (`oskvp_value_sums_mgpu.token_contiguous`: the cache's token-major [BK, S, X] transposed).
  block-major: [BK, S/128, X, 128], byte (x, t) at (t // 128)·128·X + x·128 + t % 128. A step reads one
    contiguous 128·X bytes (4 KB of codes and 1 KB of outliers at H = 128), like the key codes.

Both hold the same bytes, and a step's shared-memory tile [X, 128] is the same in both: only the global addresses of
the TMA copies differ. On an H100 the cores' TMA ring alone took 2.4–3.0% less time block-major at 64k / 128k
(`benchmarks/oskvp_stream_layout_probe.py`, results/oskvp_stream_layout_h100_s49.md). Block-major needs S to be a
multiple of `BLOCK` and a core step of `BLOCK` tokens.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import oskvp_key_scores_mgpu as ks

BLOCK = 128  # tokens per block of the block-major layout (the cores' 128-token step)


def block_major(x: jax.Array) -> jax.Array:
  """[..., X, S] tokens contiguous -> [..., S/BLOCK, X, BLOCK] block-major (the same bytes, reordered)."""
  *lead, rows, s = x.shape
  if s % BLOCK:
    raise ValueError(f"block-major values need S={s} to be a multiple of {BLOCK}")
  return jnp.swapaxes(x.reshape(*lead, rows, s // BLOCK, BLOCK), -3, -2)


def from_block_major(x: jax.Array, blocks: bool = True) -> jax.Array:
  """[..., S/BLOCK, X, BLOCK] (blocks) -> [..., X, S] tokens contiguous: `block_major`'s inverse (blocks False: x
  is already [..., X, S] and comes back as it is)."""
  if not blocks:
    return x
  *lead, n, rows, block = x.shape
  return jnp.swapaxes(x, -3, -2).reshape(*lead, rows, n * block)


def check_value_operand(x, name: str, bk: int, rows: int, s: int) -> bool:
  """Checks a core's value argument `name`: block-major [BK, S/128, X, 128] (returns True) or tokens contiguous
  [BK, X, S] (False); any other shape is refused naming the field."""
  if x.shape == (bk, rows, s):
    return False
  if s % BLOCK == 0 and x.shape == (bk, s // BLOCK, rows, BLOCK):
    return True
  blocked = f" or block-major {(bk, s // BLOCK, rows, BLOCK)}" if s % BLOCK == 0 else ""
  raise ValueError(f"{name} {x.shape} must be [BK, X, S] = {(bk, rows, s)} (tokens contiguous){blocked}")


def ring_operand(x: jax.Array) -> jax.Array:
  """A core's value operand as its kernel indexes it: [BK, X, S] as given, block-major [BK, S/128, X, 128] as
  [BK, S/128 · X, 128] (a free reshape: a step's tile is X consecutive rows)."""
  return x if x.ndim == 3 else x.reshape(x.shape[0], -1, BLOCK)


def ring_source(ref, rows: int, bk, sp, steps: int, block_s: int, blk, *, blocks: bool):
  """(BlockSpec, source ref) of one program's value tiles [rows, block_s] (swizzled) for `plgpu.emit_pipeline`: row
  bk, split sp of `steps` steps; blk maps the pipeline index to the block read (the cores' "l2_resident" ablation
  rereads one).

  ref: the kernel's `ring_operand` ref, [BK, rows, S] (blocks False) or [BK, S/128 · rows, 128] (blocks True, where
  block_s must be 128)."""
  if blocks:
    if block_s != BLOCK:
      raise ValueError(f"block-major values take {BLOCK}-token steps, not block_s={block_s}")
    spec = plgpu.BlockSpec((rows, BLOCK), lambda i: (blk(i), 0), transforms=ks.swizzled(BLOCK))
    return spec, ref.at[bk, pl.ds(sp * (steps * rows), steps * rows)]
  spec = plgpu.BlockSpec((rows, block_s), lambda i: (0, blk(i)), transforms=ks.swizzled(block_s))
  return spec, ref.at[bk, :, pl.ds(sp * (steps * block_s), steps * block_s)]
