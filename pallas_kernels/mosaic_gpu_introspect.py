"""Looking inside Mosaic GPU kernels on the CPU: where a register layout puts each element, and the lowered module.

The Mosaic GPU kernels whose register route cannot run in the CPU interpreter (inline Mosaic, wgmma A operands in
registers) are checked on the CPU in two ways: a numpy model of the register layouts and of a per-register routine
(`layout_split`, `emulate_registers`) and the text of the module they lower to for CUDA (`mosaic_module_text`, e.g.
to count wgmma instructions and their operands).
"""

from __future__ import annotations

import numpy as np
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import dialect as mgpu_dialect


def layout_split(layout, shape: tuple[int, int]) -> dict:
  """Element (r, c) of an array [R, C] in a Mosaic `TiledLayout` -> (thread dims, register index, vector position).

  Two elements with the same thread dims and register index sit in one register of one thread, at their vector
  positions: what a per-register routine (inline Mosaic on 32-bit words) sees.
  """
  rank = len(layout.tiling.tile_shape(shape))
  thread_dims = [d % rank for d in (*layout.warp_dims, *layout.lane_dims)]
  vec = layout.vector_dim % rank
  table = {}
  for r in range(shape[0]):
    for c in range(shape[1]):
      ti = layout.tiling.tile_indices((r, c))
      thread = tuple(ti[d] for d in thread_dims)
      reg = tuple(0 if d in thread_dims or d == vec else ti[d] for d in range(rank))
      table[(r, c)] = (thread, reg, ti[vec])
  return table


def mosaic_module_text(lowered) -> str:
  """The Mosaic GPU module inside a `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`, as MLIR text."""
  blobs = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.operation.name == "stablehlo.custom_call":
            blobs.append(ir.StringAttr(o.operation.attributes["mhlo.backend_config"]["module"]).value_bytes)
          walk(o.operation)

  walk(lowered.compiler_ir("stablehlo").operation)
  if not blobs:
    raise ValueError("the lowered computation holds no Mosaic GPU custom call")
  ctx = jax_mlir.make_ir_context()
  with ctx, ir.Location.unknown():
    mgpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True  # the serialized module still names the stable_mosaic_gpu dialect
    return str(ir.Module.parse(blobs[0]))


def emulate_registers(src: np.ndarray, src_layout, dst_shape: tuple[int, int], dst_layout, word_fn) -> np.ndarray:
  """numpy model of a per-register routine: uint8 src [R, C] in src_layout -> int8 dst [R', C'] in dst_layout.

  Packs src into each thread's 32-bit registers as `src_layout` places it, calls `word_fn(reg, word)` -> {dst
  register index: 32-bit word} on every register (what inline Mosaic does on the GPU), and reads dst back through
  `dst_layout`. A routine that writes a wrong register index gives a wrong matrix; a register that no source
  register feeds raises KeyError (a thread would need a word it does not hold).
  """
  words: dict = {}
  for (r, c), (thread, reg, pos) in layout_split(src_layout, src.shape).items():
    words[(thread, reg)] = words.get((thread, reg), 0) | (int(src[r, c]) << (8 * pos))
  out_words = {}
  for (thread, reg), w in words.items():
    for dst_reg, v in word_fn(reg, w).items():
      out_words[(thread, dst_reg)] = v
  out = np.full(dst_shape, -1, np.int8)
  for (r, c), (thread, reg, pos) in layout_split(dst_layout, dst_shape).items():
    out[r, c] = (out_words[(thread, reg)] >> (8 * pos)) & 0xFF
  return out
