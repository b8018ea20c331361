"""Feasibility prototype: the value-side plane sums of OS-KVP decode attention in Mosaic GPU (Hopper int8 wgmma).

The companion of `oskvp_key_scores_mgpu.py` (the key side); not wired into the attention op. Findings and the plan
for a full kernel: `benchmarks/notes_mgpu_oskvp.md` (§5, §8). Per (batch row, kv head) = one row of the leading
axis BK, the value codes are 2-bit and planar as in `oskvp_decode_attention_bitplane.py` (bits 2p, 2p + 1 of byte j
are the code c = b0 + 2 b1 of channel pQ + j, plane p = 0..3, Q = H / 4), but stored **token-contiguous**: uint8
[BK, Q, S] (byte (j, t) = the four codes of token t's channels j, Q + j, 2Q + j, 3Q + j; the same bytes as the
cache's [BK, S, Q], transposed: `token_contiguous`). With cb[c] = c0 + d1 b0 + d2 b1 + d3 b0 b1 the value output
of a query row n is o'[n, ch] = c0_ch Σ_t p[n, t] + Σ_type d_type,ch · acc[type, ch, n] with

  acc[type, ch, n] = Σ_t plane_type[ch, t] · p[n, t],        ch = pQ + j,

plane_0 = b0, plane_1 = b1, plane_2 = b0 & b1 (0/1; T = 3 plane types, 2 with symmetric codebooks; with uniform
codebooks cb[c] = c0 + d·c, T = 1 and plane_0 = c itself, 0..3, one shift and mask per plane) and p = int8
digits of the softmax probabilities (`n` = query head × digit, N = 8 for G = 4 heads × 2 digits, or 16). This
kernel computes exactly that int32 sum, with the tokens as the wgmma K axis (the contraction):

  A = int8 0/1 planes [T·H channel rows, block_s tokens] (M = channels: 2 M groups of 64 per type),
  B = int8 p [N, block_s] in shared memory, K-major (tokens contiguous: p's natural [N, S] layout), passed as p.T,
  acc = int32 [T·H, N] (one accumulator for all types, 24 registers per thread at N = 8).

int8 wgmma has K-major operands only (no transposes below 16 bits), so each 32-bit A register must hold 4
consecutive tokens of one channel: that is why the codes are token-contiguous. Each 32-bit word of the code tile
uint8 [Q, block_s] then holds 4 tokens of code byte j, and masking plane p out of it, (w >> 2p) & 0x01010101,
(w >> 2p+1) & 0x01010101, (w >> 2p) & (w >> 2p+1) & 0x01010101 (`plane_words` of the key side, 7 shifts and T·4
masks per word), gives channel pQ + j's 0/1 values for those 4 tokens, i.e. one A fragment register.

Register mapping (which thread holds which code word, and where its planes land). The s8 A fragment
(`Layout.WGMMA_8BIT`) gives thread (warp w, lane l) of the warpgroup the rows 16w + l//4 and 16w + 8 + l//4 of
each 64-row M group, 4 bytes at columns 16c + 4(l%4) of each 16-column block c. A code tile has only Q = 32 rows,
so each code word must feed two A rows (two planes): the codes are loaded in `CODE_LAYOUT` (Mosaic
`TiledLayout(Tiling(((32, 16), (8, 16), (4,))))`, warp dim = the 4 row groups of 8), where thread (w, l) holds code
row j = 32·qt + 8w + l//4 (qt = 0..Q/32 - 1), the same columns 16c + 4(l%4). Its word's plane (type t, p) becomes A
register (g, c, 0, 0, h = p % 2, ...) of M group g = t·Q/16 + (p // 2)·Q/32 + qt (`value_register_index`): A row

  ρ(t, p, j) = t·H + 64·((p // 2)·Q/32 + qt) + 16w + 8·(p % 2) + l//4,   channel p·Q + 32·qt + 8w + l//4,

so no data moves between lanes and each thread loads only its own code words (Q·block_s / 512 per thread). The
accumulator rows are therefore channels in this permuted order (`ACC` order, `acc_row_channels`); the wrapper
restores channel order on the tiny output ([T·H, N] per program), and a full kernel would rather load its value
codebook rows in the same permuted order. The mapping is checked on the CPU by a numpy model of both Mosaic layouts
(`emulate_register_planes`), and the GPU route (inline Mosaic through `plgpu.inline_mgpu`, A from registers or
shared memory) as far as lowering.

One program per (BK row, split of the sequence): the S / splits tokens' code blocks uint8 [Q, block_s] and digit
blocks int8 [N, block_s] stream through a TMA ring (`plgpu.emit_pipeline`); each block adds its int8 wgmmas
(T·H/64 M groups × block_s/32 k32 steps: 12 for T = 3, 8 for T = 2 per 64 tokens) to the program's accumulator,
written at the end as int32 partial sums [BK, splits, T, H, N] (splits are summed by the caller, or weighed by the
softmax's per-split rescaling in a full kernel). S must be a multiple of splits · block_s (no masking).

CPU interpret mode (`interpret=True`): the interpreter runs no inline Mosaic and takes the wgmma A operand from
shared memory only, so there the planes come from jnp (`value_planes_reference`, rows permuted to ACC order) and go
through a shared-memory buffer.

What the OS-KVP cache would need (not done here; the cache keeps V codes [B, K, S, Q]): V codes stored [B, K, Q, S]
(`token_contiguous` converts an existing cache); the decode append writes one token's Q bytes at stride S
(`append_token`: a `dynamic_update_slice` of a [Q, 1] column, 32 scattered bytes per kv head per token, uncoalesced
but tiny next to the attention read); prefill writes [Q, tokens] tiles (a transpose of the quantizer's output);
pages, if paged, become [Q, page_tokens] and block_s must divide the page; the Triton kernels read [S, Q], so the
layout is a static cache flag or a one-way switch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.interpret_settle import settled_when_interpreted
from pallas_kernels.mosaic_gpu_introspect import emulate_registers
from pallas_kernels.oskvp_key_scores_mgpu import (A_OPERANDS, BIT0_MASK, PLANE_TYPES, PLANES, check_loop_args,
                                                  key_planes_reference, plane_registers, plane_words, swizzled)

_ROWS = 32  # code rows per CODE_LAYOUT tile: 4 warps × 8 lane rows
_CODE_TILING = mgpu.fragmented_array.Tiling(((_ROWS, 16), (8, 16), (4,)))
#: Code tile uint8 [Q, block_s]: thread (w, l) holds row 32·qt + 8w + l//4, bytes 16c + 4(l%4) .. + 3.
CODE_LAYOUT = mgpu.TiledLayout(_CODE_TILING, warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)
CODE_LAYOUT_PL = plgpu.Layout.TILED(_CODE_TILING, warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)


# ---- Layout of the cache and references.

def token_contiguous(codes: jax.Array) -> jax.Array:
  """uint8 codes [..., S, Q] (the cache's layout) -> [..., Q, S] (tokens contiguous; the same bytes, transposed)."""
  return jnp.swapaxes(codes, -1, -2)


@jax.jit
def append_token(vt: jax.Array, codes: jax.Array, pos: jax.Array) -> jax.Array:
  """Decode append into token-contiguous codes: vt uint8 [..., Q, S], codes uint8 [..., Q] at token pos -> vt.

  One byte per code row at stride S (a [..., Q, 1] column update). Jitted.
  """
  zeros = (0,) * (vt.ndim - 1)
  return jax.lax.dynamic_update_slice(vt, codes[..., None].astype(vt.dtype), (*zeros, pos))


def value_planes_reference(vcodes: jax.Array, plane_types: int = 3) -> jax.Array:
  """uint8 codes [..., Q, S] -> int8 planes [..., T·4Q, S], row type·4Q + pQ + j (channel order): the key side's
  planes (`key_planes_reference`) of the transposed codes, transposed back."""
  return jnp.swapaxes(key_planes_reference(jnp.swapaxes(vcodes, -1, -2), plane_types), -1, -2)


@functools.partial(jax.jit, static_argnames=("plane_types",))
def value_sums_reference(p: jax.Array, vcodes: jax.Array, plane_types: int = 3) -> jax.Array:
  """XLA reference: p int8 [BK, N, S], vcodes uint8 [BK, Q, S] -> int32 [BK, T, H, N] (exact; jitted, plane_types
  static).

  out[b, type, ch, n] = Σ_t plane_type[ch, t] · p[n, t].
  """
  bk, q, _ = vcodes.shape
  planes = value_planes_reference(vcodes, plane_types).astype(jnp.int32)  # [BK, T·H, S]
  out = jnp.einsum("bcs,bns->bcn", planes, p.astype(jnp.int32))
  return out.reshape(bk, plane_types, PLANES * q, p.shape[1])


@functools.partial(jax.jit, static_argnames=("splits", "plane_types"))
def value_sums_split_reference(p: jax.Array, vcodes: jax.Array, splits: int, plane_types: int = 3) -> jax.Array:
  """The per-split sums of `value_sums_mgpu`: int32 [BK, splits, T, H, N]; split i = tokens [i·S/splits, ...).
  Jitted; splits and plane_types are static."""
  bk, n, s = p.shape
  q = vcodes.shape[1]
  ps = p.reshape(bk, n, splits, s // splits).transpose(0, 2, 1, 3).reshape(bk * splits, n, s // splits)
  vs = vcodes.reshape(bk, q, splits, s // splits).transpose(0, 2, 1, 3).reshape(bk * splits, q, s // splits)
  out = value_sums_reference(ps, vs, plane_types)
  return out.reshape(bk, splits, *out.shape[1:])


# ---- The accumulator's row order (see the module docstring).

def acc_rows(x: jax.Array, q: int, axis: int) -> jax.Array:
  """Channel order -> ACC order along `axis` (of length T·4Q): [T, p2, p1, qt, w, i] -> [T, p2, qt, w, p1, i]."""
  shape = x.shape
  axis %= x.ndim
  y = x.reshape(*shape[:axis], -1, 2, 2, q // _ROWS, 4, 8, *shape[axis + 1:])
  a = axis
  perm = (*range(a), a, a + 1, a + 3, a + 4, a + 2, a + 5, *range(a + 6, y.ndim))
  return y.transpose(perm).reshape(shape)


def channel_rows(x: jax.Array, q: int, axis: int) -> jax.Array:
  """ACC order -> channel order along `axis` (the inverse of `acc_rows`)."""
  shape = x.shape
  axis %= x.ndim
  y = x.reshape(*shape[:axis], -1, 2, q // _ROWS, 4, 2, 8, *shape[axis + 1:])
  a = axis
  perm = (*range(a), a, a + 1, a + 4, a + 2, a + 3, a + 5, *range(a + 6, y.ndim))
  return y.transpose(perm).reshape(shape)


def acc_row_channels(q: int) -> np.ndarray:
  """int [4Q]: the channel held by each accumulator row of one plane type (ACC order)."""
  return np.asarray(acc_rows(np.arange(PLANES * q), q, 0))


# ---- The GPU route: planes in registers.

def value_register_index(idx: tuple[int, ...], t: int, p: int, q: int) -> tuple[int, ...]:
  """Register index of a code word (CODE_LAYOUT, [Q, block_s]) -> of its plane (t, p) in A ([T·H, block_s], 8-bit
  wgmma layout)."""
  qt, c = idx[0], idx[1]
  g = t * (q // 16) + (p // 2) * (q // _ROWS) + qt
  return (g, c, 0, 0, p % 2, 0, 0, 0, 0)


def planes_in_registers(codes, block_s: int, q: int, plane_types: int):
  """uint8 codes [Q, block_s] (CODE_LAYOUT) -> int8 planes [T·H, block_s] in ACC row order (8-bit wgmma layout)."""
  m = plane_types * PLANES * q

  @plgpu.inline_mgpu(arg_types=(CODE_LAYOUT_PL,),
                     return_type=plgpu.ShapeDtypeStruct((m, block_s), jnp.int8, plgpu.Layout.WGMMA_8BIT))
  def planes(_, arr):  # arr registers [Q/32, block_s/16, 1, 1, 1, 1, 1]
    return plane_registers(arr, (m, block_s), lambda idx, t, p: value_register_index(idx, t, p, q), plane_types)

  return planes(codes)


def emulate_register_planes(vcodes: np.ndarray, plane_types: int = 3) -> np.ndarray:
  """numpy model of the GPU route: codes uint8 [Q, K] -> the int8 [T·4Q, K] A operand its plane registers hold.

  Splits the code tile into per-thread 32-bit words as Mosaic's CODE_LAYOUT does, runs `plane_words` and
  `value_register_index` on them and reassembles the A operand through Mosaic's `WGMMA_LAYOUT_8BIT`; rows come out
  in ACC order (compare with `value_planes_reference` rows permuted by `acc_row_channels`). Raises if a thread
  would need a word it does not hold.
  """
  q, k = vcodes.shape
  shr = lambda w, s: w >> s
  band = lambda a, b: a & (BIT0_MASK if b is None else b)

  def word_fn(reg, w):
    return {value_register_index(reg, t, p, q): v for (t, p), v in plane_words(w, shr, band, plane_types).items()}

  return emulate_registers(vcodes, CODE_LAYOUT, (plane_types * PLANES * q, k), mgpu.WGMMA_LAYOUT_8BIT, word_fn)


# ---- Kernel.

def _kernel(p_ref, v_ref, out_ref, a_smem, o_smem, *, block_s: int, steps: int, plane_types: int, a_operand: str,
            max_concurrent_steps: int, interpret: bool):
  # p_ref: int8 [BK, N, S]; v_ref: uint8 [BK, Q, S]; out_ref: int32 [BK, splits, T·H, N] (ACC row order).
  # a_smem: int8 [T·H, block_s] (the planes when A is read from shared memory); o_smem: int32 [T·H, N].
  # The pipeline's ring holds max_concurrent_steps blocks of v uint8 [Q, block_s] and p int8 [N, block_s].
  bk, sp = jax.lax.axis_index("bk"), jax.lax.axis_index("split")
  q, n = v_ref.shape[1], p_ref.shape[1]
  m = plane_types * PLANES * q
  tokens = pl.ds(sp * (steps * block_s), steps * block_s)
  v_spec = plgpu.BlockSpec((q, block_s), lambda i: (0, i), transforms=swizzled(block_s))
  p_spec = plgpu.BlockSpec((n, block_s), lambda i: (0, i), transforms=swizzled(block_s))

  def acc_scope(acc_ref):  # acc_ref: int32 [T·H, N], accumulated over the split's blocks
    def body(_, v_smem, p_smem):  # v_smem: uint8 [Q, block_s]; p_smem: int8 [N, block_s]
      if interpret:  # the interpreter: jnp planes, A through shared memory
        a_smem[...] = acc_rows(value_planes_reference(v_smem[...], plane_types), q, 0)
      else:
        codes = plgpu.load(v_smem, layout=CODE_LAYOUT_PL)  # uint8 [Q, block_s]
        planes = planes_in_registers(codes, block_s, q, plane_types)  # int8 [T·H, block_s]
        if a_operand == "registers":
          plgpu.wgmma(acc_ref, planes, p_smem.T)
          plgpu.wgmma_wait(0)  # the ring slot of p_smem is released when the body returns
          return
        a_smem[...] = planes
      plgpu.commit_smem()
      plgpu.wgmma(acc_ref, a_smem, p_smem.T)
      plgpu.wgmma_wait(0)

    plgpu.emit_pipeline(body, grid=(steps,), in_specs=[v_spec, p_spec],
                        max_concurrent_steps=max_concurrent_steps)(v_ref.at[bk, :, tokens], p_ref.at[bk, :, tokens])
    return acc_ref[...]

  o_smem[...] = pl.run_scoped(acc_scope, plgpu.ACC((m, n), jnp.int32))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bk, sp])
  plgpu.wait_smem_to_gmem(0)


def _check_inputs(p: jax.Array, vcodes: jax.Array, plane_types: int, block_s: int, splits: int, a_operand: str,
                  max_concurrent_steps: int):
  """Validates the arguments before tracing; returns (BK, N, S, Q)."""
  if p.ndim != 3 or vcodes.ndim != 3:
    raise ValueError(f"p {p.shape} must be [BK, N, S] and vcodes {vcodes.shape} [BK, Q, S] (token-contiguous)")
  if vcodes.dtype != jnp.uint8 or p.dtype != jnp.int8:
    raise TypeError(f"vcodes must be uint8 and p int8, got vcodes {vcodes.dtype} and p {p.dtype}")
  bk, n, s = p.shape
  if vcodes.shape[0] != bk or vcodes.shape[2] != s:
    raise ValueError(f"vcodes {vcodes.shape} must be [BK={bk}, Q, S={s}] like p {p.shape}")
  q = vcodes.shape[1]
  if q % _ROWS:
    raise ValueError(f"vcodes rows Q={q} must be a multiple of {_ROWS} (H = 4Q a multiple of 128)")
  if n % 8 or not 8 <= n <= 256:
    raise ValueError(f"p rows N={n} must be a multiple of 8 up to 256 (the wgmma N)")
  if plane_types not in PLANE_TYPES:
    raise ValueError(f"plane_types={plane_types!r} must be 3, 2 (symmetric codebooks) or 1 (uniform codebooks)")
  if block_s not in (64, 128):  # 32 would need a 32-byte swizzle, refused for s8 A in registers
    raise ValueError(f"block_s={block_s!r} must be 64 or 128")
  check_loop_args(s, block_s, splits, max_concurrent_steps)
  if a_operand not in A_OPERANDS:
    raise ValueError(f"a_operand={a_operand!r} must be one of {A_OPERANDS}")
  return bk, n, s, q


def interpret_kwargs(interpret) -> dict:
  if not interpret:
    return {}
  return {"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}


@settled_when_interpreted
@functools.partial(jax.jit, static_argnames=("plane_types", "block_s", "splits", "a_operand",
                                             "max_concurrent_steps", "interpret"))
def value_sums_mgpu(p: jax.Array, vcodes: jax.Array, *, plane_types: int = 3, block_s: int = 64, splits: int = 1,
                    a_operand: str = "registers", max_concurrent_steps: int = 2,
                    interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
  """int32 per-split plane sums [BK, splits, T, H, N] on the tensor cores (int8 wgmma, tokens as K).

  Args:
    p: int8 [BK, N, S], the probability digits (N = query heads × digits, a multiple of 8 up to 256).
    vcodes: uint8 [BK, Q, S], planar 2-bit value codes, token-contiguous (`token_contiguous` of the cache's
      [BK, S, Q]); Q = H / 4 a multiple of 32.
    plane_types: T = 3 (b0, b1, b0 & b1), 2 for symmetric codebooks (d3 = 0), or 1 for uniform codebooks
      (cb[c] = c0 + d·c: the codes 0..3 themselves are the A operand, 4 wgmmas per 64 tokens).
    block_s: tokens per pipeline step (64 or 128: 2 or 4 k32 steps).
    splits: programs per BK row; S must be a multiple of splits · block_s.
    a_operand: "registers" (planes extracted in registers, wgmma A from registers) or "smem" (planes stored to
      shared memory first). Interpret mode always uses shared memory.
    max_concurrent_steps: depth of the TMA ring (blocks in flight), at least 1.
    interpret: run in Mosaic GPU's CPU interpreter (True, or its `InterpretGPUParams`).

  Returns:
    int32 [BK, splits, T, H, N]: out[b, i, type, ch, n] = Σ_{t in split i} plane_type[ch, t] · p[b, n, t]
    (`value_sums_split_reference`).
  """
  bk, n, s, q = _check_inputs(p, vcodes, plane_types, block_s, splits, a_operand, max_concurrent_steps)
  steps = s // (splits * block_s)
  m = plane_types * PLANES * q
  body = functools.partial(_kernel, block_s=block_s, steps=steps, plane_types=plane_types, a_operand=a_operand,
                           max_concurrent_steps=max_concurrent_steps, interpret=bool(interpret))
  a_shape = (m, block_s) if (interpret or a_operand == "smem") else (64, block_s)  # unused with A in registers
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((bk, splits, m, n), jnp.int32), grid=(bk, splits),
      grid_names=("bk", "split"),
      scratch_types=dict(
          a_smem=plgpu.SMEM(a_shape, jnp.int8, transforms=swizzled(block_s)),
          o_smem=plgpu.SMEM((m, n), jnp.int32)),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **interpret_kwargs(interpret))
  acc = kernel(p, vcodes)  # [BK, splits, T·H (ACC order), N]
  return channel_rows(acc, q, 2).reshape(bk, splits, plane_types, PLANES * q, n)
