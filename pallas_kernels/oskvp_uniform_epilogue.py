"""The merge after the wired Mosaic GPU OS-KVP core as one Pallas (Triton) kernel
(`uniform_decode_attention(glue="pallas")`), one program per batch row, kv head and HC output channels
(`epilogue_channels`: 32 to 128, the widest that leave 256 programs in flight; 16 above 64 splits).

Inputs: the core's per-split outputs acc [splits, H, 8] (its ACC row order: each program reads its HC channels as one
block of the view `acc_view`, or HC/32 blocks of 32 for HC > 32), ml [splits, 32] (m in [0, 8), l in [8, 16)), acco
[splits, P, 8, 8] ([head, outlier channel] in P parts, summed here: `decode_core_splits`); the rotated query q' [G, H];
the prologue's qc [8]; the value codebooks cb_v = c0 + d·code [H, 4] and outlier scales [8]; the residual window res_k,
res_v [R, H] (rotated, bf16) with n_res tokens. It computes, for its HC channels:
  the splits merged by log-sum-exp (w_s = 2^(m_s − max m), mean = Σ w_s acc_s / Σ w_s l_s), o'_c = c0_v + d_v·mean
  (+ the value outliers · scale_v on channels 0..7), lse_c = max m + log2(Σ w l / 127) + qc;
  exact attention over the window (scores over all H channels, values of its own; the dots as bf16 hi + lo parts
  of the f32 operand on the tensor cores, relative error ~2^-16);
  the two merged by log-sum-exp: o' [G, HC] in the rotated basis (the live rows of the [16, HC] tile, taken by
  `live_rows`: the output needs no slice after it). U_vᵀ follows in XLA.
The reference composes `merge_splits` and the jnp glue (`epilogue_reference`).

`rotating_epilogue` (`uniform_decode_attention(output_rotation="epilogue")`) is the same merge with U_vᵀ after it in
one kernel: one program per row and kv head takes all H channels (H/32 runs, each read through `acc_view`), computes
the window's scores once, and writes o' U_vᵀ in the query's dtype; the XLA matmul after `epilogue` goes.

Each program does one round of loads and no loops. Its first form (ninth session: one program per row and kv head,
U_vᵀ inside, f32 dots, loops over splits and window chunks) took 60 µs at 64k × 8 on the H200
(results/oskvp_uniform_profile_pallas_glue.md). The core used to store acc in channel order for this kernel; that
cost the core 10% (153.8 vs 140.3 µs by CUPTI at 64k × 8, the same registers), so the reordering moved here, into
the block index of each program's read, and the whole Pallas glue became faster than the XLA glue at batch 1, 8 and
32 (eleventh session, results/decode_attention_mosaic_glue2.md; at batch 32 it had been 7–10% slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.oskvp_decode_attention import MMA_ROWS
from pallas_kernels.oskvp_decode_core_mgpu import MASKED, N, OUTLIERS, P_LEVELS, merge_splits
from pallas_kernels.oskvp_decode_prologue import live_rows, split_dot, unfold_rows
from pallas_kernels.oskvp_value_sums_mgpu import channel_rows
from pallas_kernels.oskvp_uniform_glue import LOG2E, merge_lse2, uniform_steps, window_attention

RUN = 32  # output channels per unrolled run of `rotating_epilogue` (`acc_view`'s widest block)
MAX_ROTATING_SPLITS = 64  # `rotating_epilogue` (and an `epilogue` program wider than RUN) holds S × 32 × 8 f32 a run


def _split_weights(ml_ref, qc_ref):
  """ml_ref [S, 32], qc_ref [8] -> (w [S, 8] the splits' log-sum-exp weights, inv [8] = 1 / Σ w l, lse_c16 [16] the
  compressed store's lse2 per MMA row, -inf on rows 8.. and on heads without a compressed token)."""
  m, l = ml_ref[:, pl.ds(0, N)], ml_ref[:, pl.ds(N, N)]  # [S, 8]
  top = m.max(axis=0)  # [8]
  w = jnp.exp2(m - top[None, :])  # [S, 8]
  total = (w * l).sum(axis=0)
  inv = 1.0 / jnp.maximum(total, 1e-30)
  lse_c = jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30) / P_LEVELS) + qc_ref[...], -jnp.inf)
  lse_c16 = unfold_rows([lse_c[:, None]], MMA_ROWS, jnp.float32).reshape(MMA_ROWS)
  return w, inv, jnp.where(jnp.arange(MMA_ROWS) < N, lse_c16, -jnp.inf)


def _compressed_channels(acc, w, inv, cb_ref, run, mean_o, first_channel):
  """One run of HC output channels of the compressed store: acc [S, HC, 8] f32 (channel order), the split weights
  w [S, 8] and inv [8], cb_ref [*, 4] and its rows `run` (a slice: Triton values take none), mean_o [8 heads,
  8 outlier channels] (the value outliers, already weighted and scaled; None for a run known to hold none of channels
  0..7), first_channel (the run's first channel, traced or static) -> o_c [16, HC] (rows 8.. zero)."""
  hc = acc.shape[1]
  mean = ((acc * w[:, None, :]).sum(axis=0) * inv[None, :]).T  # [8, HC]
  c0 = cb_ref[run, 0]
  o_c = c0[None, :] + (cb_ref[run, 1] - c0)[None, :] * mean  # [8, HC]
  if mean_o is not None:
    channel = first_channel + jax.lax.broadcasted_iota(jnp.int32, (OUTLIERS, hc), 1)
    onehot = (jax.lax.broadcasted_iota(jnp.int32, (OUTLIERS, hc), 0) == channel).astype(jnp.float32)  # [8, HC]
    o_c += (mean_o[:, :, None] * onehot[None]).sum(axis=1)  # channels 0..7 (none in a run past them)
  return unfold_rows([o_c], MMA_ROWS, jnp.float32)


def _value_outliers(ao_ref, sv_ref, w, inv):
  """ao_ref [S, P, 8, 8], sv_ref [8], w [S, 8], inv [8] -> the value outliers' merged sums · their scales [8, 8]."""
  return (ao_ref[...].sum(axis=1) * w[:, :, None]).sum(axis=0) * inv[:, None] * sv_ref[...][None, :]


def _window_weights(q_ref, rk_ref, nr_ref):
  """The window's scores over all H channels: q_ref [G, H] f32, rk_ref [R, H] bf16, nr_ref [] -> (p [16, R] its
  unnormalised base-2 softmax, total_r [16], lse_r [16])."""
  h, r = q_ref.shape[1], rk_ref.shape[0]
  s = split_dot(unfold_rows([q_ref[...]], MMA_ROWS, jnp.float32), rk_ref[...].T) * (h**-0.5 * LOG2E)  # [16, R]
  live = jax.lax.broadcasted_iota(jnp.int32, (MMA_ROWS, r), 1) < nr_ref[...]
  m_r = jnp.where(live, s, MASKED).max(axis=1)
  p = jnp.where(live, jnp.exp2(s - m_r[:, None]), 0.0)
  total_r = p.sum(axis=1)
  return p, total_r, jnp.where(total_r > 0, m_r + jnp.log2(jnp.maximum(total_r, 1e-30)), -jnp.inf)


def _joined(o_c16, lse_c16, p, total_r, lse_r, rv):
  """The compressed rows o_c16 [16, HC] and the window (p [16, R], rv [R, HC] bf16) joined by log-sum-exp ->
  [16, HC] (zeros where both sides are empty)."""
  o_r = split_dot(p, rv) / jnp.maximum(total_r, 1e-30)[:, None]  # [16, HC]
  top2 = jnp.maximum(jnp.maximum(lse_c16, lse_r), MASKED)
  w1, w2 = jnp.exp2(lse_c16 - top2), jnp.exp2(lse_r - top2)
  return (w1[:, None] * o_c16 + w2[:, None] * o_r) / jnp.maximum(w1 + w2, 1e-30)[:, None]


def _joined_runs(acc_refs, ml_ref, ao_ref, q_ref, qc_ref, cb_ref, sv_ref, rk_ref, rv_ref, nr_ref, first_channel):
  """The merge both epilogue kernels share: the split weights, the value outliers and the window's scores once, then
  per acc run (acc_refs: each [S, W/8, 8, 8] f32, run c holding the program's channels [cW, (c + 1)W)) its
  compressed channels joined with the window. cb_ref [*, 4] and rv_ref [R, *] hold the runs' channels in order;
  first_channel is run 0's channel in the head (traced or static). Yields (run, joined [16, W]) with run the slice
  of those refs' channel axis (the whole axis for a single run: Triton values take no slices)."""
  splits, width = acc_refs[0].shape[0], acc_refs[0].shape[1] * acc_refs[0].shape[2]
  w, inv, lse_c16 = _split_weights(ml_ref, qc_ref)
  mean_o = _value_outliers(ao_ref, sv_ref, w, inv)
  p, total_r, lse_r = _window_weights(q_ref, rk_ref, nr_ref)
  for c, acc_ref in enumerate(acc_refs):
    run = slice(None) if len(acc_refs) == 1 else pl.ds(c * width, width)
    acc = acc_ref[...].reshape(splits, width, N)
    # runs after the first start at channel 32 or later: no value outlier there (statically)
    o_c16 = _compressed_channels(acc, w, inv, cb_ref, run, mean_o if c * width < OUTLIERS else None,
                                 first_channel + c * width)
    yield run, _joined(o_c16, lse_c16, p, total_r, lse_r, rv_ref[:, run])


def _epilogue_kernel(*refs, runs: int):
  # refs: acc_ref × runs [S, W/8, 8, 8] f32 (this program's HC = runs·W channels, run c holding [cW, (c + 1)W), in
  # channel order once merged: `acc_view`), ml_ref [S, 32], ao_ref [S, P, 8, 8] ([head, outlier channel] in P
  # parts), q_ref [G, H] f32 (rotated), qc_ref [8], cb_ref [HC, 4], sv_ref [8], rk_ref [R, H] bf16, rv_ref [R, HC]
  # bf16, nr_ref [], o_ref [G, HC] f32. The window's scores once, then each run merged, joined and stored; one round
  # of loads, no loops (the runs unroll).
  o_ref = refs[-1]
  for run, joined in _joined_runs(refs[:runs], *refs[runs:-1], pl.program_id(2) * o_ref.shape[1]):
    out = live_rows(joined, o_ref.shape[0])
    if runs == 1:
      o_ref[...] = out
    else:
      o_ref[:, run] = out


def _rotating_epilogue_kernel(*refs, runs: int):
  # refs: acc_ref × runs [S, 4, 8, 8] f32 (run c: channels [32c, 32c + 32), `acc_view`), ml_ref [S, 32], ao_ref
  # [S, P, 8, 8], q_ref [G, H] f32, qc_ref [8], cb_ref [H, 4], sv_ref [8], rk_ref, rv_ref [R, H] bf16, nr_ref [],
  # u_ref [C, H] f32 (this program's C rows of U_v: its output channels), o_ref [G, C] (the query's dtype). The
  # window's scores once, then per run of 32 channels its joined output times its 32 columns of U_v; one round of
  # loads, no loops (the runs unroll).
  u_ref, o_ref = refs[-2:]
  out = None
  for run, joined in _joined_runs(refs[:runs], *refs[runs:-2], 0):
    part = split_dot(joined, u_ref[:, run].T)  # [16, C]
    out = part if out is None else out + part
  o_ref[...] = live_rows(out, o_ref.shape[0]).astype(o_ref.dtype)


EPILOGUE_PROGRAMS = 256  # `epilogue_channels` widens programs while this many stay in flight
MAX_EPILOGUE_CHANNELS = 128  # ... up to this many output channels each


def epilogue_channels(splits: int, rows: int = 1, head_dim: int = 128) -> int:
  """Output channels per epilogue program for `rows` = B × K rows: above 64 splits 16 (a program's acc block, splits ×
  HC × 8 f32, up to 64 KB); else the widest power of two from 32 up to `MAX_EPILOGUE_CHANNELS` (dividing H) that
  leaves `EPILOGUE_PROGRAMS` programs in flight: 32 at batch 1 and 8 (× 8 kv heads), 64 at 16, 128 at 32 and more.

  A wider program scores the residual window once for all its channels (a 32-channel program scores it again for
  each 32). Measured on an H100 (forty-eighth session, GPU span of the wired path, mma core, the widths in one call
  per batch; results/decode_attention_wide_epilogue_*_h100_s48.md): 128 channels at batch 32 −8.7 / −3.3 / −1.6 /
  −0.8% at 4k / 16k / 64k / 128k against 32, at batch 64 −5.1 / −1.2% at 16k / 64k; 64 at batch 16 −1.0 / −0.5%
  at 16k / 64k (128 there +2.3 / +0.6%); at batch 8, 32 stays the fastest at 4k–128k (64: +0.4 to +2.4%, 128:
  +1.7 to +12.4%). Alone (CUPTI, `oskvp_epilogue_bench.py`) with the U_vᵀ matmul:
  batch 32 × 2 splits 18.9 µs against 28.8, batch 1 × 32 splits 8.2 at 32 channels against 9.7 at 64. Earlier, on
  the H200 (CUPTI, eleventh session), 32 channels took 6.7 µs against 10.0 for 16 at batch 1 × 64 splits, 8.0 vs
  23.3 at batch 8 × 16 splits and 24.2 vs 92.5 at batch 32 (8 warps were slower in every case)."""
  if splits > MAX_ROTATING_SPLITS:
    return 16
  hc = RUN
  while (2 * hc <= min(MAX_EPILOGUE_CHANNELS, head_dim) and head_dim % (2 * hc) == 0
         and rows * (head_dim // (2 * hc)) >= EPILOGUE_PROGRAMS):
    hc *= 2
  return hc


def acc_view(acc: jax.Array, hc: int) -> tuple[jax.Array, tuple[int, ...], callable]:
  """The core's acc [..., H, 8] in its ACC row order [p2, qt, w, p1, i] (`oskvp_value_sums_mgpu.acc_row_channels`,
  channel ((2 p2 + p1) nq + qt) · 32 + 8 w + i, nq = H / 128) as [..., 2, nq, 4, 2, 8, 8] (a free reshape), with
  the block shape and block index that read output channels [c·hc, (c + 1)·hc) (hc 16 or 32: 8 consecutive channels
  per w): returns (view, block shape of its last six axes with None for the squeezed ones, c -> block indices)."""
  h = acc.shape[-2]
  nq, per_run = h // 128, 32 // hc
  view = acc.reshape(*acc.shape[:-2], 2, nq, 4, 2, 8, acc.shape[-1])

  def index(c):
    run, part = c // per_run, c % per_run  # the 32-channel run (p2, p1, qt) and the hc channels within it
    return run // (2 * nq), run % nq, part, (run // nq) % 2, 0, 0

  return view, (None, None, hc // 8, None, 8, acc.shape[-1]), index


def epilogue_shape_error(window: int, splits: int, head_dim: int, channels: int | None = None,
                         group: int | None = None) -> str | None:
  """Why `epilogue` cannot take a window of R tokens, this many splits, head dim, output channels per program and
  query heads per kv head (Triton tiles are powers of two; `acc_view` reads the core's row order in runs of 128
  channels; the prologue's and `live_rows`' row groups divide 8), or None."""
  if window < 16 or window & (window - 1) or splits & (splits - 1):
    return f"the window R={window} (at least 16) and splits={splits} must be powers of two"
  if head_dim % 128:
    return f"head_dim={head_dim} must be a multiple of 128 (the core's accumulator row order)"
  if channels not in (None, 16, 32) and (channels <= 0 or channels % RUN or channels & (channels - 1)
                                        or head_dim % channels):
    return f"channels={channels} must be 16, 32 or a power-of-two multiple of 32 dividing H={head_dim}"
  if channels is not None and channels > RUN and splits > MAX_ROTATING_SPLITS:
    return (f"channels={channels} with splits={splits}: a program wider than {RUN} channels takes at most "
            f"{MAX_ROTATING_SPLITS} splits")
  if group is not None and N % group:
    return f"G={group} query heads per kv head must divide {N}"
  return None


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "channels"))
def epilogue(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res, *, interpret: bool = False,
             num_warps: int = 4, channels: int | None = None):
  """`epilogue_reference` in one Pallas kernel (grid B × K × H/HC, HC = channels or `epilogue_channels`). Shapes as
  there; the window R and the splits must be powers of two (Triton tiles), R ≥ 16. A program of HC > 32 channels
  scores the window once for all of them and merges them in HC/32 unrolled runs (at most `MAX_ROTATING_SPLITS`
  splits)."""
  b, kh, splits, h, _ = acc.shape
  g, r = q_rot.shape[2], res_k.shape[2]
  error = epilogue_shape_error(r, splits, h, channels, g)
  if error:
    raise ValueError(error)
  hc = channels or epilogue_channels(splits, b * kh, h)
  runs = max(1, hc // RUN)
  spec = lambda *tail, cols=None: pl.BlockSpec(
      (None, None, *tail), lambda i, j, c: (i, j) + tuple(c if k == cols else 0 for k in range(len(tail))))
  acc, acc_block, acc_index = acc_view(acc, hc // runs)
  acc_specs = [pl.BlockSpec((None, None, splits, *acc_block), lambda i, j, c, run=run: (i, j, 0,
                                                                                         *acc_index(c * runs + run)))
               for run in range(runs)]
  return pl.pallas_call(
      functools.partial(_epilogue_kernel, runs=runs), grid=(b, kh, h // hc),
      in_specs=[*acc_specs, spec(splits, ml.shape[-1]), spec(splits, acco.shape[3], N, OUTLIERS), spec(g, h), spec(N),
                spec(hc, 4, cols=0), spec(OUTLIERS), spec(r, h), spec(r, hc, cols=1),
                pl.BlockSpec((None,), lambda i, j, c: (i,))],
      out_specs=spec(g, hc, cols=1),
      out_shape=jax.ShapeDtypeStruct((b, kh, g, h), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
      name="oskvp_uniform_epilogue",
  )(*[acc] * runs, ml, acco, q_rot.astype(jnp.float32), qc, cb_v.astype(jnp.float32), scale_v.astype(jnp.float32),
    res_k, res_v, n_res.astype(jnp.int32))


@jax.jit
def epilogue_reference(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res):
  """The core's per-split outputs acc [B, K, S, H, 8] (ACC row order), ml [B, K, S, 32], acco [B, K, S, P, 8, 8]
  ([head, outlier channel] in P parts); q_rot f32 [B, K, G, H]; the prologue's qc [B, K, 8]; cb_v [B, K, H, 4], scale_v
  [B, K, 8], res_k, res_v [B, K, R, H], n_res int32 [B] -> o' f32 [B, K, G, H] in the rotated basis:
  `merge_splits`, the value codebooks and outliers, `window_attention`, `merge_lse2`. Jitted."""
  b, kh, _, h, _ = acc.shape
  g = q_rot.shape[2]
  # [B, K, 8, H], [B, K, 8, 8], [B, K, 8]
  mean, mean_o, lse_c = merge_splits(channel_rows(acc, h // 4, 3), ml, acco.sum(axis=3))
  c0, d = uniform_steps(cb_v)
  o_c = (c0[:, :, None, :] + d[:, :, None, :] * mean).at[..., :OUTLIERS].add(mean_o * scale_v[:, :, None, :])
  rows = lambda x: x.reshape(b * kh, *x.shape[2:])
  with jax.default_matmul_precision("highest"):
    o_r, lse_r = window_attention(rows(q_rot).astype(jnp.float32), rows(res_k), rows(res_v), jnp.repeat(n_res, kh),
                                  scale=h**-0.5)
  pad = ((0, 0), (0, MMA_ROWS - g))
  o, _ = merge_lse2(jnp.pad(rows(o_c), ((0, 0), (0, MMA_ROWS - N), (0, 0))),
                    jnp.pad(rows(lse_c + qc), ((0, 0), (0, MMA_ROWS - N)), constant_values=-jnp.inf),
                    jnp.pad(o_r, (*pad, (0, 0))), jnp.pad(lse_r, pad, constant_values=-jnp.inf))  # [BK, 16, H]
  return o.reshape(b, kh, MMA_ROWS, h)[:, :, :g]


def rotating_epilogue_shape_error(window: int, splits: int, head_dim: int, group: int | None = None) -> str | None:
  """Why `rotating_epilogue` cannot take these shapes (`epilogue_shape_error`'s, and at most `MAX_ROTATING_SPLITS`
  splits: one program holds all H channels' acc), or None."""
  error = epilogue_shape_error(window, splits, head_dim, RUN, group)
  if error is None and head_dim & (head_dim - 1):  # its output channels default to H, a power of two
    return f"head_dim={head_dim}: the rotating epilogue takes a power of two"
  if error is None and splits > MAX_ROTATING_SPLITS:
    return (f"splits={splits}: the rotating epilogue takes at most {MAX_ROTATING_SPLITS} (one program holds all H "
            "channels)")
  return error


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "out_dtype", "out_channels"))
def rotating_epilogue(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res, u_v, *, out_dtype=jnp.float32,
                      interpret: bool = False, num_warps: int = 4, out_channels: int | None = None):
  """`epilogue` and the rotation back by U_vᵀ in one Pallas kernel: the XLA matmul after `epilogue` (and the cast to
  out_dtype fused into it) goes. Grid B × K × H/C, C = out_channels (None: H): each program merges all H channels
  (in H/32 unrolled runs) and writes C output channels, so C < H repeats the merge H/C times for H/C times the
  programs. Shapes as in `rotating_epilogue_reference`; refuses what `rotating_epilogue_shape_error` names."""
  b, kh, splits, h, _ = acc.shape
  g, r = q_rot.shape[2], res_k.shape[2]
  cols = out_channels or h
  error = rotating_epilogue_shape_error(r, splits, h, g)
  if error is None and (h % cols or cols < 16 or cols & (cols - 1)):
    error = f"out_channels={out_channels} must be a power of two of at least 16 dividing H={h}"
  if error:
    raise ValueError(error)
  whole = lambda *tail: pl.BlockSpec((None, None, *tail), lambda i, j, o: (i, j) + (0,) * len(tail))
  acc, acc_block, acc_index = acc_view(acc, RUN)
  acc_specs = [pl.BlockSpec((None, None, splits, *acc_block), lambda i, j, o, c=c: (i, j, 0, *acc_index(c)))
               for c in range(h // RUN)]
  return pl.pallas_call(
      functools.partial(_rotating_epilogue_kernel, runs=h // RUN), grid=(b, kh, h // cols),
      in_specs=[*acc_specs, whole(splits, ml.shape[-1]), whole(splits, acco.shape[3], N, OUTLIERS), whole(g, h),
                whole(N), whole(h, 4), whole(OUTLIERS), whole(r, h), whole(r, h),
                pl.BlockSpec((None,), lambda i, j, o: (i,)),
                pl.BlockSpec((None, None, cols, h), lambda i, j, o: (i, j, o, 0))],
      out_specs=pl.BlockSpec((None, None, g, cols), lambda i, j, o: (i, j, 0, o)),
      out_shape=jax.ShapeDtypeStruct((b, kh, g, h), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
      name="oskvp_rotating_epilogue",
  )(*[acc] * (h // RUN), ml, acco, q_rot.astype(jnp.float32), qc, cb_v.astype(jnp.float32),
    scale_v.astype(jnp.float32), res_k, res_v, n_res.astype(jnp.int32), u_v.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def rotating_epilogue_reference(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res, u_v, *,
                                out_dtype=jnp.float32):
  """`epilogue_reference`'s o' [B, K, G, H] rotated back, o' U_vᵀ with u_v f32 [B, K, H, H] (f32 products), in
  out_dtype. Jitted."""
  o = epilogue_reference(acc, ml, acco, q_rot, qc, cb_v, scale_v, res_k, res_v, n_res)
  with jax.default_matmul_precision("highest"):
    return jnp.einsum("BKGJ,BKHJ->BKGH", o, u_v.astype(jnp.float32)).astype(out_dtype)
