"""Decode attention over a uniform-codebook OS-KVP cache (`kv_cache="oskvp_uniform"`) through a fused Mosaic GPU
core (`pallas_kernels/oskvp_decode_core_mma.py` where it applies, else `oskvp_decode_core_mgpu.py`): `attend_codes`
(the compressed store: codes and fp8 outliers), `window_attention` (the bf16 residual window), `merge_lse2` (their
log-sum-exp merge) and `uniform_decode_attention` (the whole op on the layer cache's arrays, what `decode_step` runs
on the GPU).

Per row b of BK = batch × kv heads, with the rotated query q' [G, H] of its G ≤ 8 query heads and uniform codebooks
cb[ch, c] = c0[ch] + d[ch]·c (outlier channels: d = 0, c0 their centre):

  score[n, t] = scale · Σ_ch q'[n, ch] · cb_k[ch, code_k[t, ch]]
              = scale · (q'·c0_k)[n] + scale · Σ_ch (q'·d_k)[n, ch] · code_k[t, ch]
  o'[n, ch] = c0_v[ch] + d_v[ch] · Σ_t p[n, t] · code_v[t, ch]

The kernel takes one int8 digit per head of q'·d_k (`query_digits`; per-head scale u_n = max|q'·d_k| / 127) and
base-2 logits; the constant scale·q'·c0_k does not change the softmax and is added back to the log-sum-exp.
With `outliers`, the fp8 channels 0..7 of both sides join through the kernel's f16 path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_decode_core_mma as dm
from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels import oskvp_uniform_epilogue as epi
from pallas_kernels import oskvp_uniform_prologue as pro
from pallas_kernels import oskvp_value_layout as vl
from pallas_kernels import oskvp_value_sums_mgpu as vs
from pallas_kernels.decode_checks import check_integer_lengths
# The jnp glue lives in pallas_kernels (the Triton prologue and epilogue build their references from it); re-exported.
from pallas_kernels.oskvp_uniform_glue import (  # pylint: disable=unused-import
    LOG2E, merge_lse2, outlier_query, query_digits, uniform_steps, window_attention)


def attend_codes(q_rot: jax.Array, kcodes: jax.Array, vcodes_t: jax.Array, cb_k: jax.Array, cb_v: jax.Array,
                 lengths: jax.Array, outliers: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None, *,
                 scale: float, implementation: str = "pallas", interpret: bool = False, block_s: int = 128,
                 splits: int = 16, max_concurrent_steps: int = 2,
                 value_outliers: str = dc.VALUE_OUTLIERS) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of q' over the stored compressed tokens, in the rotated basis.

  Args:
    q_rot: f32 [BK, G, H], the rotated queries (q @ U_k) of one kv head's group.
    kcodes: uint8 [BK, S, Q] key codes (the cache's layout); vcodes_t: uint8 [BK, Q, S] value codes,
      token-contiguous (`oskvp_value_sums_mgpu.token_contiguous`), or block-major [BK, S/128, Q, 128]
      (`oskvp_value_layout`).
    cb_k, cb_v: f32 [BK, H, 4] uniform codebooks (`oskvp.fit(uniform=True)`).
    lengths: int32 [BK], stored tokens per row.
    outliers: None (codes only), or (outl_k fp8 [BK, S, 8], scale_k f32 [BK, 8], outl_v_t fp8 [BK, 8, S],
      scale_v f32 [BK, 8]): the cache's fp8 channels 0..7 (rotated channel j = c0_j + outl_j · scale_j; the codebook
      rows of those channels are their centres c0_j, d_j = 0), the value channels in vcodes_t's layout.
    scale: the softmax scale (1/√H).
    implementation: "pallas" (the Mosaic GPU core; `interpret=True` on the CPU) or "xla" (exact: dense softmax over
      the dequantized codes, no digit or p quantization).
    value_outliers: the core's form of the value-outlier sums (`decode_core_mgpu`; the same sums in every form).

  Returns:
    (o' f32 [BK, G, H] rotated outputs of the code tokens, lse2 f32 [BK, G] = log2 Σ_t 2^(score·log2 e), -inf for a
    row without tokens).
  """
  g = q_rot.shape[1]
  c0_v, d_v = uniform_steps(cb_v.astype(jnp.float32))
  o = 0 if outliers is None else outliers[0].shape[-1]
  if outliers is not None and o != dc.OUTLIERS:
    raise ValueError(f"the kernel takes {dc.OUTLIERS} outlier channels per side, got {o}")
  if implementation == "xla":
    blocks = vcodes_t.ndim == 4
    vcodes_t = vl.from_block_major(vcodes_t, blocks)
    if outliers is not None:
      outliers = (*outliers[:2], vl.from_block_major(outliers[2], blocks), outliers[3])
    c0_k, d_k = uniform_steps(cb_k.astype(jnp.float32))
    keys = c0_k[:, None, :] + d_k[:, None, :] * ks.key_planes_reference(kcodes, 1).astype(jnp.float32)  # [BK, S, H]
    if outliers is not None:
      keys = keys.at[..., :o].add(outliers[0].astype(jnp.float32) * outliers[1][:, None, :])
    s = jnp.einsum("bgh,bsh->bgs", q_rot.astype(jnp.float32), keys) * (scale * LOG2E)
    valid = jnp.arange(kcodes.shape[1])[None, None, :] < lengths[:, None, None]
    s = jnp.where(valid, s, -jnp.inf)
    top = jnp.maximum(s.max(axis=-1, keepdims=True), dc.MASKED)
    p = jnp.exp2(s - top)
    total = p.sum(axis=-1)
    vcode = vs.value_planes_reference(vcodes_t, 1).astype(jnp.float32)  # [BK, H, S]
    mean_code = jnp.einsum("bgs,bhs->bgh", p, vcode) / jnp.maximum(total, 1e-30)[..., None]
    if outliers is not None:
      mean_outl = jnp.einsum("bgs,bos->bgo", p, outliers[2].astype(jnp.float32)) / jnp.maximum(total, 1e-30)[..., None]
    lse2 = jnp.where(total > 0, top[..., 0] + jnp.log2(jnp.maximum(total, 1e-30)), -jnp.inf)
  elif implementation == "pallas":
    qd, qs, const = query_digits(q_rot, cb_k, scale)
    kw = dict(block_s=block_s, splits=splits, max_concurrent_steps=max_concurrent_steps, interpret=interpret,
              return_lse2=True, value_outliers=value_outliers)
    if outliers is None:
      mean_code, lse2 = dc.decode_core_mgpu(kcodes, vcodes_t, qd, qs, lengths, **kw)
    else:
      outl_k, scale_k, outl_v_t, _ = outliers
      mean_code, mean_outl, lse2 = dc.decode_core_mgpu(kcodes, vcodes_t, qd, qs, lengths, outl_k, outl_v_t,
                                                       outlier_query(q_rot, scale_k, scale), **kw)
      mean_outl = mean_outl[:, :g]
    mean_code, lse2 = mean_code[:, :g], lse2[:, :g] + const
  else:
    raise ValueError(f"implementation={implementation!r} must be 'pallas' or 'xla'")
  out = c0_v[:, None, :] + d_v[:, None, :] * mean_code
  if outliers is not None:
    out = out.at[..., :o].add(mean_outl * outliers[3][:, None, :])
  return jnp.where(jnp.isfinite(lse2)[..., None], out, 0.0), lse2


# ---- Decode attention over a whole uniform cache (the layer cache's layout, values tokens contiguous or block-major).

MOSAIC_BLOCK = 128  # tokens per pipeline step of the core
MOSAIC_MAX_SPLITS = 16  # the wgmma core's programs per row × kv head (run 2 of results/oskvp_decode_core_mgpu.md)
MOSAIC_PROGRAMS = 512  # programs the core wants in flight: 4 per SM fit (by registers) on the H200's 132 SMs
# The mma core's base: no floor, the fewest splits that put MOSAIC_PROGRAMS programs in flight (batch 8 × 8 kv
# heads: 8, batch 16: 4, batch 32: 2, batch 4: 16 as before; batch 1 and 2: 32). On an H100, by GPU span at
# 4k-128k, it was the fastest of 16 / 8 / 4 / 2 splits or within 2.2% of it at batch 8, 16 and 32, and 0.2-20%
# faster than a base of 16 there (results/decode_attention_splits*_h100_s47.md). Its raise stops at 32 splits
# (`MMA_SPLITS_CAP`): at batch 1 (8 rows) 32 splits were 6–8% faster than 64 at 16k and 0.3–1.2% at 64k / 128k in
# two calls, par at 4k (`..._splits_b1_h100_s47.md`, `..._splits_b12_h100_s47.md`); batch 2 (32 splits) unchanged.
MMA_SPLITS_BASE = 1
MMA_SPLITS_CAP = 32
MOSAIC_SPLITS_CAP = 128  # the wgmma core's


def mosaic_tiling(capacity: int, head_dim: int, group: int, n_outliers: int, rows: int | None = None,
                  max_splits: int | None = None, base: int = MOSAIC_MAX_SPLITS,
                  cap: int = MOSAIC_SPLITS_CAP) -> tuple[int, int] | None:
  """(block_s, splits) of the Mosaic GPU core for a cache of `capacity` tokens, or None where the core does not apply
  (head_dim other than a multiple of 128, more than 8 query heads per kv head, other than 8 outlier channels, or a
  capacity that is not a multiple of 64).

  splits: the largest power of two up to max_splits that divides the blocks. max_splits None: `base` (16, the wgmma
  core's; the mma core's is `MMA_SPLITS_BASE`, `wired_tiling`), raised for a few rows (`rows` = batch × kv heads)
  until rows × splits reaches MOSAIC_PROGRAMS or `cap` (128, the mma core's 32): at batch 1 × 8 kv heads, 16 splits
  give 128 programs, one per SM, and the core waits on memory latency.
  """
  if head_dim % 128 or group > dc.N or n_outliers != dc.OUTLIERS:
    return None
  if max_splits is None:
    max_splits = base
    while rows and rows * max_splits < MOSAIC_PROGRAMS and max_splits < cap:
      max_splits *= 2
  if max_splits < 1:
    raise ValueError(f"max_splits={max_splits} must be at least 1")
  for block_s in (MOSAIC_BLOCK, 64):
    if capacity % block_s == 0:
      blocks = capacity // block_s
      return block_s, math.gcd(blocks, 1 << (max_splits.bit_length() - 1))
  return None


def resolved_glue(glue: str, window: int, splits: int, head_dim: int, group: int | None = None) -> str:
  """The glue `uniform_decode_attention` runs: "auto" is "pallas" where the Pallas prologue and epilogue take the
  window, splits, head dim and group size (`oskvp_uniform_epilogue.epilogue_shape_error`), else "xla"."""
  if glue not in ("auto", "pallas", "xla"):
    raise ValueError(f"glue={glue!r} must be 'auto', 'pallas' or 'xla'")
  if glue != "auto":
    return glue
  return "xla" if epi.epilogue_shape_error(window, splits, head_dim, group=group) else "pallas"


def resolved_core(core: str, *, glue: str, block_s: int, head_dim: int, interpret: bool, value_outliers: str,
                  mma_key_rows: str, split_tokens: int = 0) -> str:
  """The core `uniform_decode_attention` runs: "auto" is "mma" (`oskvp_decode_core_mma`) where it applies (the
  Pallas glue, 128-token blocks, H = 128, a GPU, at most `MAX_SPLIT_TOKENS` tokens per program (`split_tokens`:
  S / splits), the default value-outlier form, which the mma core does not take as an option), else "wgmma"; "mma"
  where it does not apply, or an unknown core or key orientation, is refused."""
  if core not in ("auto", "wgmma", "mma"):
    raise ValueError(f"core={core!r} must be 'auto', 'wgmma' or 'mma'")
  if mma_key_rows not in dm.KEY_ROWS:
    raise ValueError(f"mma_key_rows={mma_key_rows!r} must be one of {dm.KEY_ROWS}")
  applies = (glue == "pallas" and block_s == dm.BLOCK_S and head_dim == 4 * dm.Q and not interpret
             and split_tokens <= dm.MAX_SPLIT_TOKENS)
  if core == "auto":
    return "mma" if applies and value_outliers == dc.VALUE_OUTLIERS else "wgmma"
  if core == "mma" and not applies:
    raise ValueError(f"core='mma' takes the Pallas glue (here {glue!r}), blocks of {dm.BLOCK_S} tokens (here "
                     f"{block_s}), H={4 * dm.Q} (here {head_dim}), at most {dm.MAX_SPLIT_TOKENS} tokens per "
                     f"program (here {split_tokens}) and a GPU (interpret={interpret})")
  if core == "mma" and value_outliers != dc.VALUE_OUTLIERS:
    raise ValueError(f"value_outliers={value_outliers!r} is a form of the wgmma core's; core='mma' has one form")
  return core


def wired_tiling(capacity: int, head_dim: int, group: int, n_outliers: int, rows: int, window: int, *,
                 max_splits: int | None, glue: str, core: str, interpret: bool, value_outliers: str,
                 mma_key_rows: str) -> tuple[int, int, str, str]:
  """(block_s, splits, glue, core) that `uniform_decode_attention` runs for a cache of `capacity` tokens, `rows` =
  batch × kv heads and a window of `window` tokens; the other arguments as there.

  The splits follow the core: with max_splits None the mma core takes the fewest that put MOSAIC_PROGRAMS programs
  in flight, at most 32 (`MMA_SPLITS_BASE`, `MMA_SPLITS_CAP`; and enough that a program holds at most
  `MAX_SPLIT_TOKENS`), the wgmma core starts from 16 (`MOSAIC_MAX_SPLITS`) and stops raising at 128. The mma core's
  tiling is tried first where it may run; if the core resolves to wgmma there (e.g. the XLA glue, the interpreter),
  the wgmma core's tiling is taken instead.

  Raises:
    ValueError: for shapes the core does not take (`mosaic_tiling`), and as `resolved_glue` / `resolved_core` do.
  """
  fit = -(-capacity // dm.MAX_SPLIT_TOKENS)  # splits that keep a program's tokens within the mma core's int32 sums
  wgmma = (MOSAIC_MAX_SPLITS, MOSAIC_SPLITS_CAP)
  rules = ([wgmma] if core == "wgmma" or max_splits is not None
           else [(max(MMA_SPLITS_BASE, 1 << (fit - 1).bit_length()), MMA_SPLITS_CAP), wgmma])
  for base, cap in rules:
    tiling = mosaic_tiling(capacity, head_dim, group, n_outliers, rows=rows, max_splits=max_splits, base=base,
                           cap=cap)
    if tiling is None:
      raise ValueError(f"the Mosaic GPU core does not take G={group} query heads per kv head, H={head_dim}, "
                       f"capacity S={capacity}, O={n_outliers} (needs G = N/K <= {dc.N}, H a multiple of 128, "
                       "8 outlier channels, S a multiple of 64)")
    block_s, splits = tiling
    resolved = resolved_glue(glue, window, splits, head_dim, group)
    chosen = resolved_core(core, glue=resolved, block_s=block_s, head_dim=head_dim, interpret=interpret,
                           split_tokens=capacity // splits, value_outliers=value_outliers, mma_key_rows=mma_key_rows)
    if chosen == "mma" or (base, cap) == wgmma:
      return block_s, splits, resolved, chosen
  raise AssertionError("unreachable: the last rule is the wgmma core's")


QUERY_ROTATIONS = ("prologue", "xla")
OUTPUT_ROTATIONS = ("epilogue", "xla")


@functools.partial(jax.jit, static_argnames=("interpret", "max_concurrent_steps", "glue", "value_outliers",
                                             "max_splits", "core", "mma_key_rows", "query_rotation",
                                             "output_rotation", "epilogue_channels"))
def uniform_decode_attention(q, codes_k, outl_k, scale_k, cb_k, codes_v_t, outl_v_t, scale_v, cb_v, u_k, u_v, res_k,
                             res_v, n_comp, n_res, *, interpret: bool = False, max_concurrent_steps: int = 2,
                             glue: str = "auto", value_outliers: str = dc.VALUE_OUTLIERS,
                             max_splits: int | None = None, core: str = "auto",
                             mma_key_rows: str = dm.KEY_ROW_DEFAULT,
                             query_rotation: str = "xla", output_rotation: str = "xla",
                             epilogue_channels: int | None = None) -> jax.Array:
  """One query per head over a uniform-codebook OS-KVP cache through the fused Mosaic GPU core.

  The compressed store goes through the core (codes and fp8 outlier channels), the residual window through exact
  attention; the two are merged by log-sum-exp and rotated back by U_vᵀ. glue="xla" composes `attend_codes`,
  `window_attention` and `merge_lse2` in jnp: about eighteen small XLA kernels beside the core. glue="pallas" keeps
  the two rotations as XLA matmuls (q U_k optionally inside the prologue: `query_rotation`) and runs the query
  preparation and the split merge + window as two Pallas (Triton) kernels around the core
  (`pallas_kernels/oskvp_uniform_prologue.py`, `oskvp_uniform_epilogue.py`); with the two rotations and a final cast,
  six to eight GPU kernels per call (one fewer with q U_k in the prologue). On the H200 the GPU runs either back to
  back (results/decode_timeline.md); by GPU time per call the Pallas glue is faster at every batch (1, 8, 32) and
  context (16k, 64k) measured, by 1–16% (results/decode_attention_mosaic_glue2.md), since the core leaves its
  accumulator in ACC row order and the epilogue reorders in its reads. glue="auto" (the default) takes the Pallas glue
  where its tiles apply (`oskvp_uniform_epilogue.epilogue_shape_error`: power-of-two window and splits), else the XLA
  glue.

  Args:
    q: [B, N, H] unrotated queries (N = K·G, G ≤ 8, H a multiple of 128).
    codes_k: uint8 [B, K, S, H/4]; outl_k: float8_e4m3fn [B, K, S, 8]; codes_v_t: uint8 [B, K, H/4, S] and
      outl_v_t: float8_e4m3fn [B, K, 8, S] (values tokens contiguous), or both block-major, [B, K, S/128, H/4, 128]
      and [B, K, S/128, 8, 128] (`oskvp_value_layout`: each 128-token block's rows contiguous; S a multiple of 128);
      scale_k, scale_v: f32 [B, K, 8]; cb_k, cb_v:
      f32 [B, K, H, 4] uniform codebooks; u_k, u_v: f32 [B, K, H, H]; res_k, res_v: bf16 [B, K, R, H] (rotated);
      n_comp, n_res: int32 [B].
    interpret: run the kernels in their CPU interpreters.
    max_concurrent_steps: the core's TMA ring depth (2: best with the fp8 value-outlier forms,
      results/oskvp_decode_core_mgpu_run12.md and _run13.md).
    glue: "auto", "pallas" or "xla" (see above).
    value_outliers: the core's form of the value-outlier sums ("fp8", "fp8_stacked" or "f16"; `decode_core_mgpu`).
    max_splits: programs per batch row × kv head at most (`mosaic_tiling`; None: sized for B·K and the core,
      `wired_tiling`: the mma core the fewest splits that put 512 programs in flight, at most 32; the wgmma core 16
      or more).
    core: "wgmma" (`oskvp_decode_core_mgpu`), "mma" (`oskvp_decode_core_mma`, warp-level) or "auto" (the
      default; `resolved_core`: "mma" where it applies, else "wgmma". On an H100 the mma core made the op 4–8%
      faster by GPU span at 64k / 128k × 8 / 32, results/decode_attention_mma_h100_s41c.md; not yet timed on an
      H200).
    mma_key_rows: the "mma" core's key-score orientation (`oskvp_decode_core_mma.KEY_ROWS`).
    query_rotation: where the Pallas glue computes q' = q U_k: "xla" (the default: an XLA matmul before the
      prologue) or "prologue" (inside the prologue kernel, `oskvp_uniform_prologue.rotating_prologue`: one kernel
      fewer, but 0.7–4.0% slower by GPU span on an H100, results/decode_attention_qrot_h100_s45.md; H = 128 and the
      Pallas glue only, else refused by name).
    output_rotation: where the Pallas glue computes o' U_vᵀ: "xla" (the default: an XLA matmul after the epilogue,
      the cast to q's dtype fused into it) or "epilogue" (`oskvp_uniform_epilogue.rotating_epilogue`: one program
      per row and kv head merges all H channels and rotates them, one kernel fewer, but 7.9% slower by GPU span at
      64k × 8 and 0.1–1.2% faster at batch 32 on an H100, results/decode_attention_orot_h100_s46.md; at most 64 splits,
      the Pallas glue only, else refused by name).
    epilogue_channels: output channels per program of the Pallas glue's epilogue (`oskvp_uniform_epilogue.epilogue`:
      16, 32 or a power-of-two multiple of 32 dividing H; a program over more than 32 scores the window once for all
      of them). None: `oskvp_uniform_epilogue.epilogue_channels`, the widest programs (up to 128 channels) that
      leave 256 in flight: 32 at batch 8 × 8 kv heads, 64 at 16, 128 from 32 (on an H100 0.8–8.7% faster by GPU span
      at batch 32 and 64 than 32 channels, results/decode_attention_wide_epilogue_*_h100_s48.md). Refused by name
      with the XLA glue, the rotating epilogue, or where the epilogue does not take it.

  Returns:
    [B, N, H] in q's dtype.

  Raises:
    ValueError: for shapes the core does not take (`mosaic_tiling`; the caller falls back to the Triton kernel), and
      naming the field for an unknown `core`, `mma_key_rows` or `query_rotation`, or core="mma" or
      query_rotation="prologue" where it does not apply.
  """
  if query_rotation not in QUERY_ROTATIONS:
    raise ValueError(f"query_rotation={query_rotation!r} must be one of {QUERY_ROTATIONS}")
  check_integer_lengths(n_comp=n_comp, n_res=n_res)  # the Pallas glue truncated floats; the XLA glue refused them
  if output_rotation not in OUTPUT_ROTATIONS:
    raise ValueError(f"output_rotation={output_rotation!r} must be one of {OUTPUT_ROTATIONS}")
  b, n, h = q.shape
  kh, s = codes_k.shape[1], codes_k.shape[2]
  g = n // kh
  if n % kh:
    raise ValueError(f"N={n} query heads must be a multiple of K={kh} kv heads")
  block_s, splits, glue, core = wired_tiling(s, h, g, outl_k.shape[-1], b * kh, res_k.shape[2],
                                             max_splits=max_splits, glue=glue, core=core, interpret=interpret,
                                             value_outliers=value_outliers, mma_key_rows=mma_key_rows)
  if query_rotation == "prologue" and glue != "pallas":  # (its head dim: `rotating_prologue` refuses others)
    raise ValueError(f"query_rotation='prologue' takes the Pallas glue (here {glue!r})")
  if output_rotation == "epilogue":
    error = (f"the Pallas glue (here {glue!r})" if glue != "pallas"
             else epi.rotating_epilogue_shape_error(res_k.shape[2], splits, h, g))
    if error:
      raise ValueError(f"output_rotation='epilogue' does not apply: {error}")
  if epilogue_channels is not None:
    error = (f"the Pallas glue's epilogue (here glue={glue!r}, output_rotation={output_rotation!r})"
             if glue != "pallas" or output_rotation != "xla"
             else epi.epilogue_shape_error(res_k.shape[2], splits, h, epilogue_channels, g))
    if error:
      raise ValueError(f"epilogue_channels={epilogue_channels} does not apply: {error}")
  ring = max(1, min(max_concurrent_steps, s // (splits * block_s)))
  rows = lambda x: x.reshape(b * kh, *x.shape[2:])
  rotate = lambda: jnp.einsum("BKGH,BKHJ->BKGJ", q.astype(jnp.float32).reshape(b, kh, g, h), u_k)  # [B, K, G, H]
  if glue == "pallas":
    if query_rotation == "prologue":
      q_rot, qd, qs_row, qo16, qc = pro.rotating_prologue(q.reshape(b, kh, g, h), u_k, cb_k, scale_k, n_comp,
                                                         interpret=interpret)
    else:
      q_rot = rotate()
      qd, qs_row, qo16, qc = pro.prologue(q_rot, cb_k, scale_k, n_comp, interpret=interpret)
    if core == "mma":
      acc, ml, acco = dm.decode_core_mma_splits(rows(codes_k), rows(codes_v_t), rows(qd), rows(qs_row),
                                                rows(outl_k), rows(outl_v_t), rows(qo16), splits=splits,
                                                max_concurrent_steps=ring, key_rows=mma_key_rows)
    else:
      acc, ml, acco = dc.decode_core_splits(rows(codes_k), rows(codes_v_t), rows(qd), rows(qs_row), rows(outl_k),
                                            rows(outl_v_t), rows(qo16), block_s=block_s, splits=splits,
                                            max_concurrent_steps=ring, interpret=interpret,
                                            value_outliers=value_outliers)
    per_head = lambda x: x.reshape(b, kh, *x.shape[1:])
    tail = (per_head(acc), per_head(ml), per_head(acco), q_rot, qc, cb_v, scale_v, res_k, res_v, n_res)
    if output_rotation == "epilogue":
      return epi.rotating_epilogue(*tail, u_v, out_dtype=q.dtype, interpret=interpret).reshape(b, n, h)
    o = epi.epilogue(*tail, interpret=interpret, channels=epilogue_channels)  # [B, K, G, H], rotated
  else:
    q_rows = rows(rotate())  # [BK, G, H]
    scale = h**-0.5
    o_c, lse_c = attend_codes(q_rows, rows(codes_k), rows(codes_v_t), rows(cb_k), rows(cb_v), jnp.repeat(n_comp, kh),
                              (rows(outl_k), rows(scale_k), rows(outl_v_t), rows(scale_v)), scale=scale,
                              implementation="pallas", interpret=interpret, block_s=block_s, splits=splits,
                              max_concurrent_steps=ring, value_outliers=value_outliers)
    o_r, lse_r = window_attention(q_rows, rows(res_k), rows(res_v), jnp.repeat(n_res, kh), scale=scale)
    o = merge_lse2(o_c, lse_c, o_r, lse_r)[0].reshape(b, kh, g, h)
  o = jnp.einsum("BKGJ,BKHJ->BKGH", o, u_v)  # o' @ U_vᵀ
  return o.reshape(b, n, h).astype(q.dtype)
