"""Grouped (ragged) matmul reading 2-bit vector-quantized weights, decoded inside the kernel.

Contract of `jax.lax.ragged_dot` (lhs [M, K] rows sorted by expert, W [E, K, N], group_sizes [E]), with

  W[e, g·G + r + (G/4)·j, n] = s[e, g, n] · C[c(e), idx[e, g·G/4 + r, n], j] / a[e, k]     (j = 0..3, r < G/4)

an 8-bit index per 4 weights of one column into a codebook C of 256 four-dimensional bf16 vectors (one codebook per
expert, c(e) = e, or one per layer, c(e) = 0), a float scale s per (K group of G = 128, column) and an optional
per-input-channel activation scale (`in_scale` = 1/a, applied to lhs). The four weights of a vector are G/4 apart
along K, so each codebook coordinate decodes into a contiguous [G/4, bn] tile that multiplies a contiguous slice of
lhs: no shuffles. The codebook is stored as bf16 pairs in uint32 words (coordinate 2i in the low half, 2i + 1 in the
high half) and split by half ([C, 2, 256]: each gather spans a 1 KiB table, 8 L1 lines), so a vector costs two
4-byte gathers that stay in L1, and a bf16 is unpacked exactly by shifting its bits into the top half of a float32.

Layouts: `idx` uint8 [E, Kp/4, N]; `codebook` uint32 [C, 2, 256]; `scale` [E, Kp/G, N]; `in_scale` f32 [E, Kp] or
None. Bits per weight: 2 + 16/G (the scale).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import ragged_tiles


class VQ2Weights(NamedTuple):
  """Raw arrays of one vq2 expert weight [E, K, N] (see the module docstring)."""
  idx: jax.Array
  codebook: jax.Array
  scale: jax.Array
  in_scale: jax.Array | None = None


def _bf16_lo(word):
  return jax.lax.bitcast_convert_type(word << 16, jnp.float32)


def _bf16_hi(word):
  return jax.lax.bitcast_convert_type(word & jnp.uint32(0xFFFF0000), jnp.float32)


def pack_codebook(codebook: jax.Array) -> jax.Array:
  """float [C, 256, 4] -> uint32 [C, 2, 256] bf16 pairs (rounded to bf16)."""
  bits = jax.lax.bitcast_convert_type(codebook.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
  return jnp.swapaxes(bits[..., 0::2] | (bits[..., 1::2] << 16), 1, 2)


def unpack_codebook(packed: jax.Array) -> jax.Array:
  """uint32 [C, 2, 256] -> float32 [C, 256, 4]."""
  return jnp.stack([_bf16_lo(packed[:, 0]), _bf16_hi(packed[:, 0]), _bf16_lo(packed[:, 1]),
                    _bf16_hi(packed[:, 1])], axis=-1)


ABLATIONS = ("", "gather_only", "no_gather")
NO_GATHER_WORDS = (0x00410041, 0x00410042)  # ablate="no_gather": codebook half h's word for index i is i · this[h]


def _step(load_x, ws: VQ2Weights, e, g, n0, acc, *, group_size: int, bn: int, ablate: str = ""):
  """acc float32 [bm, bn] + K group g of expert e for columns n0 : n0 + bn."""
  quarter, nt = group_size // 4, pl.ds(n0, bn)
  c = e if ws.codebook.shape[0] > 1 else 0
  idx = ws.idx[e, pl.ds(g * quarter, quarter), nt].astype(jnp.int32)  # [G/4, bn]
  coords = []
  for half in range(2):
    if ablate == "no_gather":  # the index bits stand in for the codebook word: no look-up
      word = idx.astype(jnp.uint32) * jnp.uint32(NO_GATHER_WORDS[half])
    else:
      word = ws.codebook[c, half, idx]  # uint32 [G/4, bn], gathered
    coords += [_bf16_lo(word), _bf16_hi(word)]
  if ablate == "gather_only":  # the look-ups (kept live by a column sum) and nothing of the dots or the scale
    return acc + sum(coords).sum(axis=0)[None, :]
  d = None
  for j in range(4):
    x = load_x(g * group_size + j * quarter, quarter)  # [bm, G/4]
    if ws.in_scale is not None:  # float16 stays float32 once scaled: x · (1/a) passes 65504 on a quiet channel
      scaled = x.astype(jnp.float32) * ws.in_scale[e, pl.ds(g * group_size + j * quarter, quarter)][None, :]
      x = scaled if x.dtype == jnp.float16 else scaled.astype(x.dtype)
    dj = jnp.dot(x, coords[j].astype(x.dtype), preferred_element_type=jnp.float32)
    d = dj if d is None else d + dj
  return acc + ws.scale[e, g, nt].astype(jnp.float32)[None, :] * d


def _check(lhs, ws: VQ2Weights, group_size: int, group_sizes: jax.Array, what: str = "weights"):
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be [M, Kp] (rows sorted by expert), got shape {lhs.shape}")
  e, rows, n = ws.idx.shape
  kp = rows * 4
  if lhs.shape[1] != kp:
    raise ValueError(f"lhs has K={lhs.shape[1]} but the vq2 weights hold Kp={kp}; pad lhs with zeros to Kp")
  if group_size % 64 or kp % group_size:
    raise ValueError(f"group_size={group_size} must be a multiple of 64 dividing Kp={kp}")
  if ws.codebook.shape[1:] != (2, 256) or ws.codebook.shape[0] not in (1, e) or ws.codebook.dtype != jnp.uint32:
    raise ValueError(f"codebook {ws.codebook.dtype}{ws.codebook.shape} must be uint32 (1 or E={e}, 2, 256); "
                     "see pack_codebook")
  if ws.scale.shape != (e, kp // group_size, n):
    raise ValueError(f"{what}.scale has shape {ws.scale.shape} but group_size={group_size} needs "
                     f"{(e, kp // group_size, n)}: pass the group_size the weights were quantized with")
  ragged_tiles.check_grouped_args(group_sizes, ws.in_scale, e, kp, what)
  return e, kp, n


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "num_warps", "num_stages",
                                             "interpret", "poison", "ablate"))
def vq2_grouped_matmul(lhs: jax.Array, weights: VQ2Weights, group_sizes: jax.Array, *, group_size: int = 128,
                       block_m: int | None = None, block_n: int = 128, num_warps: int = 4, num_stages: int = 3,
                       interpret: bool = False, poison: float | None = None, ablate: str = "") -> jax.Array:
  """lhs [M, Kp] (rows sorted by expert) @ vq2 W [E, Kp, N] per group_sizes [E] -> float32 [M, N].

  `ablate` is for timing experiments only (the results are wrong): "gather_only" runs the codebook look-ups and
  skips the dots and scales, "no_gather" runs everything but the look-ups (the index bits stand in for the word).
  """
  _, kp, n = _check(lhs, weights, group_size, group_sizes)
  if ablate not in ABLATIONS:
    raise ValueError(f"ablate={ablate!r} must be one of {ABLATIONS}")
  bn = ragged_tiles.pick_block_n(n, block_n)
  step = functools.partial(_step, group_size=group_size, bn=bn, ablate=ablate)
  return ragged_tiles.ragged_call(lhs, group_sizes, [weights], step, n=n, n_groups=kp // group_size,
                                  block_m=block_m, block_n=bn, num_warps=num_warps, num_stages=num_stages,
                                  interpret=interpret, poison=poison)


@functools.partial(jax.jit, static_argnames=("group_size", "block_m", "block_n", "num_warps", "num_stages",
                                             "interpret", "poison"))
def vq2_grouped_swiglu(lhs: jax.Array, gate: VQ2Weights, up: VQ2Weights, group_sizes: jax.Array, *,
                       group_size: int = 128, block_m: int | None = None, block_n: int = 128, num_warps: int = 4,
                       num_stages: int = 3, interpret: bool = False, poison: float | None = None) -> jax.Array:
  """Fused gate/up + SwiGLU: silu(lhs @ W_gate) * (lhs @ W_up) -> lhs.dtype [M, F]."""
  shape = _check(lhs, gate, group_size, group_sizes, "gate")
  ragged_tiles.check_same_shape(shape, _check(lhs, up, group_size, group_sizes, "up"))
  _, kp, n = shape
  bn = ragged_tiles.pick_block_n(n, block_n)
  step = functools.partial(_step, group_size=group_size, bn=bn)
  return ragged_tiles.ragged_call(lhs, group_sizes, [gate, up], step, n=n, n_groups=kp // group_size,
                                  epilogue=lambda a: jax.nn.silu(a[0]) * a[1], out_dtype=lhs.dtype,
                                  block_m=block_m, block_n=bn, num_warps=num_warps, num_stages=num_stages,
                                  interpret=interpret, poison=poison)


@functools.partial(jax.jit, static_argnames=("group_size", "dtype"))
def dequantize_vq2(ws: VQ2Weights, *, group_size: int = 128, dtype=jnp.float32) -> jax.Array:
  """The weight the kernel multiplies by, in plain jnp: [E, Kp, N] in dtype. Jitted; group_size and dtype are static."""
  e, rows, n = ws.idx.shape
  ng, quarter = ws.scale.shape[1], group_size // 4
  cb = jnp.broadcast_to(unpack_codebook(ws.codebook), (e, 256, 4))
  vec = jax.vmap(lambda c, i: c[i])(cb, ws.idx.astype(jnp.int32))  # [E, Kp/4, N, 4]
  vec = vec.reshape(e, ng, quarter, n, 4)
  w = jnp.moveaxis(vec, 4, 2).reshape(e, ng, group_size, n)  # slot j of vector r is k = r + (G/4)·j
  w = (w * ws.scale.astype(jnp.float32)[:, :, None, :]).reshape(e, ng * group_size, n)
  if ws.in_scale is not None:
    w = w * ws.in_scale.astype(jnp.float32)[:, :, None]
  return w.astype(dtype)


@functools.partial(jax.jit, static_argnames=("group_size",))
def vq2_grouped_matmul_reference(lhs: jax.Array, weights: VQ2Weights, group_sizes: jax.Array, *,
                                 group_size: int = 128) -> jax.Array:
  """XLA reference: dequantize to lhs.dtype, then `jax.lax.ragged_dot` with float32 accumulation (jitted; group_size
  is static)."""
  w = dequantize_vq2(weights, group_size=group_size, dtype=lhs.dtype)
  return jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("group_size",))
def vq2_grouped_swiglu_reference(lhs, gate: VQ2Weights, up: VQ2Weights, group_sizes, *, group_size=128):
  g = vq2_grouped_matmul_reference(lhs, gate, group_sizes, group_size=group_size)
  u = vq2_grouped_matmul_reference(lhs, up, group_sizes, group_size=group_size)
  return (jax.nn.silu(g) * u).astype(lhs.dtype)
