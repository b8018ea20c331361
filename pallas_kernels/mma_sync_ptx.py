"""Warp-level PTX for inline Mosaic GPU kernels (`plgpu.inline_mgpu`): `mma.sync`, shuffles, votes, conversions,
aligned shared-memory loads, and carrying per-thread values through Pallas as WGMMA-layout arrays.

Used by the warp-level OS-KVP core (`oskvp_decode_core_mma.py`). Every function emits MLIR inside a kernel; none runs
in Mosaic GPU's CPU interpreter.
"""

from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.lib.mlir.dialects import llvm
from jax._src.lib.mlir.dialects import vector
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
import numpy as np

from pallas_kernels import oskvp_core_registers_mgpu as rg


def i32():
  """The i32 MLIR type."""
  return ir.IntegerType.get_signless(32)


def f32():
  """The f32 MLIR type."""
  return ir.F32Type.get()


def asm(types, operands, ptx, constraints):
  """Inline PTX with len(types) results (a struct when several)."""
  if len(types) == 1:
    return [llvm.inline_asm(types[0], operands, ptx, constraints)]
  out = llvm.inline_asm(llvm.StructType.get_literal(types), operands, ptx, constraints)
  return [llvm.extractvalue(ty, out, [i]) for i, ty in enumerate(types)]


def _regs(prefix_count: int, n: int) -> str:
  return "{" + ",".join(f"${prefix_count + i}" for i in range(n)) + "}"


def mma(shape: str, kind: str, a, b, c):
  """D = A · B + C of one `mma.sync.aligned.{shape}.row.col` per warp: kind "s8" or "u8" (s32 accumulators) or
  "f16" (f32)."""
  integer = kind in ("s8", "u8")
  ty = i32() if integer else f32()
  acc = "s32" if integer else "f32"
  ptx = (f"mma.sync.aligned.{shape}.row.col.{acc}.{kind}.{kind}.{acc} {_regs(0, 4)}, {_regs(4, len(a))}, "
         f"{_regs(4 + len(a), len(b))}, {_regs(4 + len(a) + len(b), 4)};")
  cc = "r" if integer else "f"
  constraints = ",".join([f"={cc}"] * 4 + ["r"] * (len(a) + len(b)) + [cc] * 4)
  return asm([ty] * 4, [*a, *b, *c], ptx, constraints)


def shfl_bfly(x, mask: int):
  """x from lane ^ mask (f32)."""
  return asm([f32()], [x], f"shfl.sync.bfly.b32 $0, $1, {mask}, 31, -1;", "=f,f")[0]


def shfl_idx(x, lane):
  """x from lane `lane` (f32)."""
  return asm([f32()], [x, lane], "shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=f,f,r")[0]


def ex2(x):
  """2^x, approximate (f32)."""
  return asm([f32()], [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")[0]


def vote_any(flag):
  """i32 flag (0 / 1) of each lane -> i32 1 if any lane of the warp has it."""
  return asm([i32()], [flag], "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.any.pred q, p, -1; "
              "selp.u32 $0, 1, 0, q; }", "=r,r")[0]


def dp4a(a, b, c):
  """c + the dot product of a's and b's four unsigned bytes."""
  return asm([i32()], [a, b, c], "dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r")[0]


def f16x2(lo, hi):
  """Two f32 -> one f16x2 register (lo in the low half)."""
  return asm([i32()], [hi, lo], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")[0]


def e4m3x2(pair):
  """i32 whose low 16 bits are two e4m3 bytes -> f16x2 as an i32 register (byte 0 in the low half)."""
  return mgpu.utils.bitcast(rg.cvt_e4m3x2(arith.trunci(ir.IntegerType.get_signless(16), pair)), i32())


def load(ref, offset, nbytes: int):
  """nbytes (2, 4 or 8) at byte `offset` (an i32 value or int) of a shared-memory ref, as one aligned load: a list
  of i32 words (one i16 for 2 bytes). Explicit alignment: a vector.load of i8 elements may be split into bytes."""
  i64, i16 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(16)
  offset = mgpu.utils.c(offset, i64) if isinstance(offset, int) else arith.extui(i64, offset)
  ptr = mgpu.utils.getelementptr(mgpu.utils.memref_ptr(ref), [offset], ir.IntegerType.get_signless(8))
  if nbytes == 2:
    return [llvm.load(i16, ptr, alignment=2)]
  if nbytes == 4:
    return [llvm.load(i32(), ptr, alignment=4)]
  pair = llvm.load(ir.VectorType.get((2,), i32()), ptr, alignment=8)
  return [vector.extract(pair, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i])) for i in range(2)]


def scalars(arr) -> list:
  """A FragmentedArray's per-thread values, flattened."""
  out = []
  for reg in arr.registers.flat:
    for i in range(ir.VectorType(reg.type).shape[0]):
      out.append(vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i])))
  return out


def fragment(values: list, like_shape: tuple[int, int], dtype) -> mgpu.FragmentedArray:
  """Per-thread values -> a FragmentedArray [like_shape] in the WGMMA layout (an opaque carrier of registers)."""
  shape = mgpu.WGMMA_LAYOUT.registers_shape(like_shape)
  regs = np.empty(shape, dtype=object)
  flat = regs.reshape(-1)
  vec_ty = ir.VectorType.get((2,), values[0].type)
  for i in range(flat.size):
    flat[i] = vector.from_elements(vec_ty, values[2 * i:2 * i + 2])
  return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT,
                              _is_signed=True if jnp.issubdtype(dtype, jnp.integer) else None)


def movmatrix_t(x):
  """One 8 × 8 matrix of 16-bit values transposed across the warp (thread (g, t) holds row g, columns 2t, 2t + 1)."""
  return asm([i32()], [x], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")[0]


def floor(x):
  """floor(x) (f32)."""
  return asm([f32()], [x], "cvt.rmi.f32.f32 $0, $1;", "=f,f")[0]
