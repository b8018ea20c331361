"""Feasibility prototype: the key-score half of OS-KVP decode attention in Mosaic GPU (Hopper int8 wgmma).

Not wired into the attention op; `benchmarks/notes_mgpu_oskvp.md` holds the findings and the plan for a full
kernel. Per (batch row, kv head) = one row of the leading axis BK, the keys of a token are 2-bit codes stored
planar as in `oskvp_decode_attention_bitplane.py`: uint8 codes [S, Q], Q = H / 4, bits 2p, 2p + 1 of byte j are
the code c = b0 + 2 b1 of channel pQ + j (plane p = 0..3). With cb[c] = c0 + d1 b0 + d2 b1 + d3 b0 b1 the scores
minus the constant sum_j q_j c0_j are

  s[t, n] = sum_{type, p, j} plane_{type}[t, pQ + j] · qd[n, type·H + pQ + j],

plane_0 = b0, plane_1 = b1, plane_2 = b0 & b1 (0/1), qd = int8 digits of q * d_type (`n` = query head × digit,
N = 8 for G = 4 heads × 2 digits). This kernel computes exactly that int32 product, transposed so that the tokens
are the wgmma M dimension:

  A = int8 [block_s tokens, T·H] planes (T = 3 plane types, 2 with symmetric codebooks), the K axis of the wgmma;
      with uniform codebooks (cb[c] = c0 + d·c, T = 1) A is the codes 0..3 themselves, [block_s, H],
  B = int8 qd [N, T·H] (K-major, the only B layout of int8 wgmma), acc = int32 [block_s, N].

One program per (BK row, token block): TMA loads the code bytes [block_s, Q] (32-byte swizzle) and qd (128-byte
swizzle), a warpgroup loads the codes in Mosaic's 8-bit wgmma layout (`Layout.WGMMA_8BIT`: each thread holds 4
consecutive bytes of a row in one 32-bit register, exactly an s8 wgmma A fragment) and turns each register into the
T·4 plane registers with 32-bit shifts and masks (`plane_words`: (w >> 2p) & 0x01010101, (w >> 2p+1) & 0x01010101,
(w >> 2p) & (w >> 2p+1) & 0x01010101). Since plane p's channels sit at K offset type·H + pQ, the extracted register
of code column block j (16 bytes) is the A register of K column block (type·H + pQ) / 16 + j: no data moves between
lanes. The wgmma then takes A from registers (`a_operand="registers"`) or, as fallback, from shared memory.

Sequence-loop variant (`key_scores_mgpu_loop`, the shape a full decode kernel has): one program per (BK row,
split of the sequence) loads qd once and streams its S / splits tokens' code blocks through a TMA ring
(`plgpu.emit_pipeline`), scoring each block as above. Output "scores" (int32 [BK, S, N], for checking) or "max"
(int32 [BK, splits, N]: the max over the split's tokens per column, `key_scores_max_reference`, kept as an
elementwise running max of the [block_s, N] tiles in registers and reduced over rows once per program), so that
the timed bytes are the codes'. S must be a multiple of splits · block_s (ValueError otherwise; no masking).

Why inline Mosaic (`plgpu.inline_mgpu`) instead of jnp: Mosaic GPU's FragmentedArray refuses shifts on 8-bit
types ("Pointwise operations on 8-bit types are unsupported (except bitwise operations)"), and a jnp concatenate of
the planes would be a relayout; the inline function works on the 32-bit words directly.

CPU interpret mode (`interpret=True`): the interpreter runs no inline Mosaic and takes the wgmma A operand from
shared memory only, so there the planes come from jnp (`key_planes_reference` on the loaded tile) through a
shared-memory buffer. The register mapping of the GPU route is checked on the CPU by a numpy emulation of the
8-bit wgmma layout (`emulate_register_planes`), and the GPU route itself only as far as lowering.
"""

from __future__ import annotations

import functools

import jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.interpret_settle import settled_when_interpreted
from pallas_kernels.mosaic_gpu_introspect import emulate_registers

PLANES = 4  # 2-bit codes in a byte
BIT0_MASK = 0x01010101  # the low bit of each of the 4 bytes of a 32-bit word
CODE_MASK = 0x03030303  # the low 2 bits (one code) of each of the 4 bytes (T = 1: the codes themselves as A)
_COL_BLOCK = 16  # columns of one 8-bit wgmma layout tile (a thread holds 4 of them per row)
A_OPERANDS = ("registers", "smem")
PLANE_TYPES = (1, 2, 3)  # 3: general codebooks; 2: symmetric (d3 = 0); 1: uniform (cb[c] = c0 + d·c)


def key_planes_reference(codes: jax.Array, plane_types: int = 3) -> jax.Array:
  """uint8 codes [..., S, Q] -> int8 planes [..., S, T·4Q], K index type·4Q + pQ + j (T = plane_types).

  T = 3: b0, b1, b0 & b1 (0/1); T = 2: b0, b1; T = 1 (uniform codebooks): the codes c = b0 + 2 b1 (0..3).
  """
  c = codes.astype(jnp.int32)
  if plane_types == 1:
    return jnp.concatenate([(c >> (2 * p)) & 3 for p in range(PLANES)], axis=-1).astype(jnp.int8)
  b0 = jnp.concatenate([(c >> (2 * p)) & 1 for p in range(PLANES)], axis=-1)  # [..., S, H]
  b1 = jnp.concatenate([(c >> (2 * p + 1)) & 1 for p in range(PLANES)], axis=-1)
  return jnp.concatenate([b0, b1, b0 & b1][:plane_types], axis=-1).astype(jnp.int8)


@jax.jit
def key_scores_reference(codes: jax.Array, qdigits: jax.Array) -> jax.Array:
  """XLA reference: codes uint8 [BK, S, Q], qdigits int8 [BK, N, T·H] -> int32 [BK, S, N] (exact; jitted)."""
  plane_types = qdigits.shape[-1] // (PLANES * codes.shape[-1])
  planes = key_planes_reference(codes, plane_types).astype(jnp.int32)
  return jnp.einsum("bsk,bnk->bsn", planes, qdigits.astype(jnp.int32))


def plane_words(word, shr, band, plane_types: int = 3) -> dict[tuple[int, int], object]:
  """One 32-bit word of 4 code bytes -> {(type, plane): word of 4 int8 values}.

  `shr(w, k)` and `band(a, b)` are the 32-bit ops (MLIR arith on the GPU, numpy in the emulation); `band(x, None)`
  applies BIT0_MASK, `band(x, mask)` an int mask. T = 3 / 2: 0/1 bit planes, 7 shifts and T·4 masks per word
  (ptxas fuses the b0 & b1 pair and its mask into one LOP3): 19 instructions per word for 3 plane types, 15 for 2.
  T = 1: the codes (0..3), 3 shifts and 4 masks per word (CODE_MASK).
  """
  if plane_types == 1:
    return {(0, p): band(shr(word, 2 * p) if p else word, CODE_MASK) for p in range(PLANES)}
  sh = [word] + [shr(word, k) for k in range(1, 2 * PLANES)]
  out = {}
  for p in range(PLANES):
    lo, hi = sh[2 * p], sh[2 * p + 1]
    out[(0, p)] = band(lo, None)
    out[(1, p)] = band(hi, None)
    if plane_types == 3:
      out[(2, p)] = band(band(lo, hi), None)
  return out


def plane_register_index(idx: tuple[int, ...], t: int, p: int, q: int) -> tuple[int, ...]:
  """Register index (8-bit wgmma layout) of code tile [M, Q] -> register index of plane tile [M, T·4Q]."""
  blocks = q // _COL_BLOCK  # column blocks of one plane
  return (idx[0], (t * PLANES + p) * blocks + idx[1], *idx[2:])


def plane_registers(arr, out_shape: tuple[int, int], register_index, plane_types: int):
  """Inside `plgpu.inline_mgpu`: code bytes (a FragmentedArray of 32-bit words of 4 bytes) -> int8 0/1 planes.

  Each source register goes through `plane_words`; plane (t, p) of source register `idx` becomes register
  `register_index(idx, t, p)` of the result, an int8 [out_shape] array in the 8-bit wgmma layout (an A operand).
  """
  i32 = ir.IntegerType.get_signless(32)
  i8x4 = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
  mask = mgpu.utils.c(BIT0_MASK, i32)
  shr = lambda w, s: arith.shrui(w, mgpu.utils.c(s, i32))
  band = lambda a, b: arith.andi(a, mask if b is None else mgpu.utils.c(b, i32) if isinstance(b, int) else b)
  regs = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape(out_shape), dtype=object)
  for idx in np.ndindex(arr.registers.shape):
    words = plane_words(mgpu.utils.bitcast(arr.registers[idx], i32), shr, band, plane_types)
    for (t, p), w in words.items():
      regs[register_index(idx, t, p)] = mgpu.utils.bitcast(w, i8x4)
  if any(r is None for r in regs.flat):
    raise ValueError("register_index leaves registers of the plane array unwritten")
  # wgmma reads int8 A as s8 (it rejects unsigned A); the planes are 0/1, so the sign is moot.
  return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT_8BIT, _is_signed=True)


def planes_in_registers(codes, block_s: int, q: int, plane_types: int):
  """uint8 codes [block_s, Q] (8-bit wgmma layout) -> int8 planes [block_s, T·4Q] in the same layout (A operand)."""
  k = plane_types * PLANES * q

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                     return_type=plgpu.ShapeDtypeStruct((block_s, k), jnp.int8, plgpu.Layout.WGMMA_8BIT))
  def planes(_, arr):  # arr registers [block_s/64, Q/16, 1, 1, 2, 1, 1, 1, 1]
    return plane_registers(arr, (block_s, k), lambda idx, t, p: plane_register_index(idx, t, p, q), plane_types)

  return planes(codes)


def emulate_register_planes(codes: np.ndarray, plane_types: int = 3) -> np.ndarray:
  """numpy model of the GPU route: codes uint8 [M, Q] -> the int8 [M, T·4Q] matrix its plane registers hold.

  Splits the tile into per-thread 32-bit registers as Mosaic's `WGMMA_LAYOUT_8BIT` does (its `Tiling`, warp, lane
  and vector dims), runs `plane_words` and `plane_register_index` on them, and reassembles the A operand through
  the same layout, so that a wrong register index shows up as a wrong matrix on the CPU.
  """
  m, q = codes.shape
  shr = lambda w, s: w >> s
  band = lambda a, b: a & (BIT0_MASK if b is None else b)

  def word_fn(reg, w):
    return {plane_register_index(reg, t, p, q): v for (t, p), v in plane_words(w, shr, band, plane_types).items()}

  layout = mgpu.WGMMA_LAYOUT_8BIT
  return emulate_registers(codes, layout, (m, plane_types * PLANES * q), layout, word_fn)


def swizzled(minor_bytes: int):
  """TMA transforms of a shared-memory tile whose minor dimension is `minor_bytes` wide: 8-row tiling, swizzle."""
  swizzle = plgpu.find_swizzle(minor_bytes * 8)
  return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def block_scores(c_smem, q_smem, a_smem, *, n: int, plane_types: int, a_operand: str, interpret: bool):
  """One token block: c_smem uint8 [block_s, Q], q_smem int8 [N, T·H] -> int32 [block_s, N] (WGMMA layout).

  a_smem: int8 [block_s, T·H], the planes when A is read from shared memory (interpret mode or a_operand="smem").
  Waits for its wgmmas, so the caller may reuse c_smem and a_smem afterwards.
  """
  block_s, q = c_smem.shape

  def acc_scope(acc_ref):  # acc_ref: int32 [block_s, N]
    if interpret:  # the interpreter: jnp planes, A through shared memory
      a_smem[...] = key_planes_reference(c_smem[...], plane_types)
    else:
      codes = plgpu.load(c_smem, layout=plgpu.Layout.WGMMA_8BIT)  # uint8 [block_s, Q]
      planes = planes_in_registers(codes, block_s, q, plane_types)  # int8 [block_s, T·H]
      if a_operand == "registers":
        plgpu.wgmma(acc_ref, planes, q_smem.T)
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      a_smem[...] = planes
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, a_smem, q_smem.T)
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  return pl.run_scoped(acc_scope, plgpu.ACC((block_s, n), jnp.int32))


def _kernel(codes_ref, qd_ref, out_ref, c_smem, q_smem, a_smem, o_smem, bar, *, block_s: int, plane_types: int,
            a_operand: str, interpret: bool):
  # codes_ref: uint8 [BK, S, Q]; qd_ref: int8 [BK, N, T·H]; out_ref: int32 [BK, S, N].
  # c_smem: uint8 [block_s, Q]; q_smem: int8 [N, T·H]; a_smem: int8 [block_s, T·H] (the planes when A is read
  # from shared memory); o_smem: int32 [block_s, N]; bar: 2 barriers.
  bk, i = jax.lax.axis_index("bk"), jax.lax.axis_index("s")
  rows = pl.ds(i * block_s, block_s)
  plgpu.copy_gmem_to_smem(codes_ref.at[bk, rows], c_smem, bar.at[0])
  plgpu.copy_gmem_to_smem(qd_ref.at[bk], q_smem, bar.at[1])
  plgpu.barrier_wait(bar.at[0])
  plgpu.barrier_wait(bar.at[1])
  o_smem[...] = block_scores(c_smem, q_smem, a_smem, n=o_smem.shape[1], plane_types=plane_types,
                              a_operand=a_operand, interpret=interpret)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bk, rows])
  plgpu.wait_smem_to_gmem(0)


def _check_inputs(codes: jax.Array, qdigits: jax.Array, block_s: int, a_operand: str):
  """Validates the arguments shared by both kernels; returns (BK, S, Q, N, T·H, T)."""
  if codes.ndim != 3 or qdigits.ndim != 3:
    raise ValueError(f"codes {codes.shape} must be [BK, S, Q] and qdigits {qdigits.shape} [BK, N, T·H]")
  bk, s, q = codes.shape
  _, n, k = qdigits.shape
  plane_types = k // (PLANES * q)
  if codes.dtype != jnp.uint8 or qdigits.dtype != jnp.int8:
    raise TypeError(f"codes must be uint8 and qdigits int8, got {codes.dtype} and {qdigits.dtype}")
  if plane_types not in PLANE_TYPES or k != plane_types * PLANES * q or qdigits.shape[0] != bk:
    raise ValueError(f"qdigits {qdigits.shape} must be [BK={bk}, N, T·H] with T in {PLANE_TYPES} and "
                     f"H = {PLANES * q}")
  if q % _COL_BLOCK or n % 8 or n > 256 or block_s not in (64, 128) or s % block_s:
    raise ValueError(f"need Q={q} a multiple of {_COL_BLOCK}, N={n} a multiple of 8 up to 256, block_s={block_s} "
                     f"in (64, 128) dividing S={s}")
  if a_operand not in A_OPERANDS:
    raise ValueError(f"a_operand={a_operand!r} must be one of {A_OPERANDS}")
  return bk, s, q, n, k, plane_types


def interpret_kwargs(interpret) -> dict:
  if not interpret:
    return {}
  return {"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=("block_s", "a_operand", "interpret"))
def key_scores_mgpu(codes: jax.Array, qdigits: jax.Array, *, block_s: int = 64, a_operand: str = "registers",
                    interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
  """int32 scores [BK, S, N] = planes(codes) @ qdigits^T on the tensor cores (int8 wgmma, tokens as M).

  Args:
    codes: uint8 [BK, S, Q], planar 2-bit key codes (Q = H / 4, a multiple of 16).
    qdigits: int8 [BK, N, T·H], the query digits folded with the codebook deltas, K index type·H + channel
      (T = 3, or 2 for symmetric codebooks); N a multiple of 8 up to 256.
    block_s: tokens per program (64 or 128: one or two wgmma M groups); divides S.
    a_operand: "registers" (planes extracted in registers, wgmma A from registers) or "smem" (planes stored to
      shared memory first). Interpret mode always uses shared memory.
    interpret: run in Mosaic GPU's CPU interpreter (True, or its `InterpretGPUParams`).
  """
  bk, s, q, n, k, plane_types = _check_inputs(codes, qdigits, block_s, a_operand)
  body = functools.partial(_kernel, block_s=block_s, plane_types=plane_types, a_operand=a_operand,
                           interpret=bool(interpret))
  a_shape = (block_s, k) if (interpret or a_operand == "smem") else (64, 128)  # unused with A in registers
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((bk, s, n), jnp.int32), grid=(bk, s // block_s), grid_names=("bk", "s"),
      scratch_types=dict(
          c_smem=plgpu.SMEM((block_s, q), jnp.uint8, transforms=swizzled(q)),
          q_smem=plgpu.SMEM((n, k), jnp.int8, transforms=swizzled(128)),
          a_smem=plgpu.SMEM(a_shape, jnp.int8, transforms=swizzled(128)),
          o_smem=plgpu.SMEM((block_s, n), jnp.int32),
          bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **interpret_kwargs(interpret))
  return kernel(codes, qdigits)


# ---- Sequence-loop variant: one program per (BK row, split of the sequence), code blocks through a TMA pipeline.

@functools.partial(jax.jit, static_argnames=("splits",))
def key_scores_max_reference(codes: jax.Array, qdigits: jax.Array, splits: int) -> jax.Array:
  """XLA reference of output="max": the max over each split's tokens, int32 [BK, splits, N].

  Split j holds tokens [j·S/splits, (j + 1)·S/splits) (splits divides S). Jitted; splits is static.
  """
  scores = key_scores_reference(codes, qdigits)  # [BK, S, N]
  bk, s, n = scores.shape
  return scores.reshape(bk, splits, s // splits, n).max(axis=2)


def _loop_kernel(codes_ref, qd_ref, out_ref, q_smem, a_smem, o_smem, r_smem, bar, *, block_s: int, steps: int,
                 plane_types: int, a_operand: str, output: str, max_concurrent_steps: int, interpret: bool):
  # codes_ref: uint8 [BK, S, Q]; qd_ref: int8 [BK, N, T·H]; out_ref: int32 [BK, S, N] (output="scores") or
  # [BK, splits, N] (output="max"). q_smem: int8 [N, T·H], loaded once per program; a_smem: int8 [block_s, T·H]
  # (planes when A is read from shared memory); o_smem: int32 [2, block_s, N] (score tiles, output="scores");
  # r_smem: int32 [N] (the split's max); bar: 1 barrier. The pipeline's ring holds max_concurrent_steps code
  # blocks uint8 [block_s, Q].
  bk, sp = jax.lax.axis_index("bk"), jax.lax.axis_index("split")
  plgpu.copy_gmem_to_smem(qd_ref.at[bk], q_smem, bar.at[0])
  plgpu.barrier_wait(bar.at[0])
  q, n = codes_ref.shape[-1], q_smem.shape[0]
  tokens = pl.ds(sp * (steps * block_s), steps * block_s)
  c_spec = plgpu.BlockSpec((block_s, q), lambda i: (i, 0), transforms=swizzled(q))
  scores = functools.partial(block_scores, q_smem=q_smem, a_smem=a_smem, n=n, plane_types=plane_types,
                             a_operand=a_operand, interpret=interpret)

  if output == "scores":
    # The score tiles are stored by hand from a 2-slot buffer rather than through the pipeline's out_specs (whose
    # predicated stores the CPU interpreter does not run): a slot is rewritten once its store two steps back has
    # read it.
    first = sp * steps

    def body(idx, c_smem):  # c_smem: uint8 [block_s, Q]
      (i,) = idx
      slot = jax.lax.rem(i, 2)
      tile = scores(c_smem)  # int32 [block_s, N]
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      o_smem.at[slot][...] = tile
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[slot], out_ref.at[bk, pl.ds((first + i) * block_s, block_s)])

    plgpu.emit_pipeline(body, grid=(steps,), in_specs=[c_spec], max_concurrent_steps=max_concurrent_steps)(
        codes_ref.at[bk, tokens])
    plgpu.wait_smem_to_gmem(0)
    return

  # output == "max": an elementwise running max of the [block_s, N] score tiles in registers (one max per
  # accumulator register per block), reduced over the block's rows (across warps, through shared memory) once.
  def body(_, c_smem, run_max):  # run_max: int32 [block_s, N]
    return jnp.maximum(run_max, scores(c_smem))

  init = plgpu.layout_cast(jnp.full((block_s, n), jnp.iinfo(jnp.int32).min, jnp.int32), plgpu.Layout.WGMMA)
  run_max = plgpu.emit_pipeline(body, grid=(steps,), in_specs=[c_spec], max_concurrent_steps=max_concurrent_steps,
                                init_carry=init)(codes_ref.at[bk, tokens])
  r_smem[...] = jnp.max(run_max, axis=0)  # [N]
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(r_smem, out_ref.at[bk, sp])
  plgpu.wait_smem_to_gmem(0)


OUTPUTS = ("scores", "max")


def check_loop_args(s: int, block_s: int, splits, max_concurrent_steps) -> None:
  """The sequence-loop kernels' split of S tokens: splits programs of whole blocks, a TMA ring of >= 1 steps."""
  if not isinstance(splits, int) or splits < 1 or s % (splits * block_s):
    raise ValueError(f"splits={splits!r} must be a positive int with S={s} a multiple of splits·block_s = "
                     f"{splits}·{block_s} (no masking of partial blocks or splits)")
  if not isinstance(max_concurrent_steps, int) or max_concurrent_steps < 1:
    raise ValueError(f"max_concurrent_steps={max_concurrent_steps!r} must be a positive int")


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=("block_s", "splits", "output", "a_operand", "max_concurrent_steps",
                                             "interpret"))
def key_scores_mgpu_loop(codes: jax.Array, qdigits: jax.Array, *, block_s: int = 64, splits: int = 1,
                         output: str = "scores", a_operand: str = "registers", max_concurrent_steps: int = 4,
                         interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
  """The key scores of `key_scores_mgpu`, one program per (BK row, split) looping over its token blocks.

  Each program loads its qdigits once, streams the code blocks uint8 [block_s, Q] of its S / splits tokens
  through a TMA ring (`plgpu.emit_pipeline`, max_concurrent_steps deep) and scores each block with the same int8
  wgmma route as `key_scores_mgpu` (planes in registers, or through shared memory).

  Args:
    codes: uint8 [BK, S, Q], planar 2-bit key codes (Q = H / 4, a multiple of 16).
    qdigits: int8 [BK, N, T·H] as in `key_scores_mgpu`.
    block_s: tokens per pipeline step (64 or 128).
    splits: programs per BK row; S must be a multiple of splits·block_s (no masking: other S raise ValueError).
    output: "scores" -> int32 [BK, S, N] (all scores, for checking), or "max" -> int32 [BK, splits, N], the max
      over each split's tokens per column n (`key_scores_max_reference`), the running max a softmax needs; its
      output is 4·N bytes per program, so the codes dominate the bytes moved.
    a_operand: "registers" or "smem", as in `key_scores_mgpu` (interpret mode always uses shared memory).
    max_concurrent_steps: depth of the TMA ring (code blocks in flight), at least 1.
    interpret: run in Mosaic GPU's CPU interpreter (True, or its `InterpretGPUParams`).
  """
  bk, s, q, n, k, plane_types = _check_inputs(codes, qdigits, block_s, a_operand)
  check_loop_args(s, block_s, splits, max_concurrent_steps)
  if output not in OUTPUTS:
    raise ValueError(f"output={output!r} must be one of {OUTPUTS}")
  steps = s // (splits * block_s)
  body = functools.partial(_loop_kernel, block_s=block_s, steps=steps, plane_types=plane_types,
                           a_operand=a_operand, output=output, max_concurrent_steps=max_concurrent_steps,
                           interpret=bool(interpret))
  a_shape = (block_s, k) if (interpret or a_operand == "smem") else (64, 128)  # unused with A in registers
  out_shape = (bk, s, n) if output == "scores" else (bk, splits, n)
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(out_shape, jnp.int32), grid=(bk, splits), grid_names=("bk", "split"),
      scratch_types=dict(
          q_smem=plgpu.SMEM((n, k), jnp.int8, transforms=swizzled(128)),
          a_smem=plgpu.SMEM(a_shape, jnp.int8, transforms=swizzled(128)),
          o_smem=plgpu.SMEM((2, block_s, n) if output == "scores" else (1, 8, n), jnp.int32),
          r_smem=plgpu.SMEM((n,), jnp.int32),
          bar=plgpu.Barrier(num_arrivals=1, num_barriers=1)),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **interpret_kwargs(interpret))
  return kernel(codes, qdigits)
