"""Decode attention on the GPU: the OS-KVP Pallas kernel next to cuDNN, jax's Pallas decode kernel and XLA.

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/decode_attention.py --out=$OUT
Phases (one process, one run): (1) correctness of the Pallas kernel against its jnp reference on fresh random
inputs (ragged lengths, G 1/4/8, H 64/128, poisoned partials); (2) a tiling sweep at 64k x batch 8; (3) the grid
contexts x batches with every implementation, copy bandwidth measured in the same run. Writes
decode_attention.{md,json} under --out (and --results if given).

`--merge=A.json,B.json` runs nothing: it writes one decode_attention.{md,json} under --out from earlier runs'
files (each context x batch from the last file that has it), every row labelled with its run; a row's "vs cuDNN"
is always against the cuDNN row of its own run.

Timing (`chained_timing.py`): each measurement jits `calls` back-to-back invocations (distinct queries, rotating
over enough copies of the cache to exceed 3x the 60 MB L2), takes the median over `reps` runs after warm-up and
divides by `calls`; `--span` also reads the GPU span of that program, and the copy bandwidth is timed both ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime
import itertools
import json
import os
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.chained_timing import chained_calls, copy_bandwidth, copy_bandwidth_span, timeit
from pallas_kernels.oskvp_decode_attention import (BITPLANE, PLAIN_ROWS, DecodeBlockConfig, _oskvp_pallas,
                                                   oskvp_decode_attention_reference)
from pallas_kernels.oskvp_random import random_oskvp_inputs
from pallas_kernels import per_token_decode_attention as ptda

warnings.filterwarnings("ignore", category=DeprecationWarning)
N_HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 8, 128, 128


def timing_row(impl: str, b: int, s: int, ms: float, nbytes: float, copy_tbs: float, note: str = "",
               span_ms: float | None = None, copy_span_tbs: float | None = None) -> dict:
  """One result row: wall-clock ms per call and its rate over the wall-clock copy (`frac_copy_bw`); with a GPU span,
  the span and, where the copy was timed by span too, the span's rate over that copy (`frac_copy_bw_span`)."""
  row = dict(impl=impl, batch=b, context=s, ms=ms, bytes_read=int(nbytes), tb_per_s=nbytes / ms / 1e9,
             frac_copy_bw=nbytes / ms / 1e9 / copy_tbs, note=note)
  if span_ms is not None:
    row["span_ms"] = span_ms
    if copy_span_tbs:
      row["frac_copy_bw_span"] = nbytes / span_ms / 1e9 / copy_span_tbs
  return row


# ------------------------------------------------------------------------------------------------- peers (bf16 etc.)


def bf16_cache(key, b, s):
  k1, k2 = jax.random.split(key)
  shape = (b, KV_HEADS, s, HEAD_DIM)  # [B, K, S, H]
  return (jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16))


def xla_bf16(q, k, v):
  """q [B, N, H] bf16, k/v [B, K, S, H] bf16 -> [B, N, H]."""
  b, n, h = q.shape
  qg = q.reshape(b, KV_HEADS, n // KV_HEADS, h)
  s = jnp.einsum("BKGH,BKSH->BKGS", qg, k, preferred_element_type=jnp.float32) * h**-0.5
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("BKGS,BKSH->BKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32).reshape(b, n, h)


def cudnn_bf16(q, k, v):
  """q [B, N, H], k/v [B, S, K, H] (cuDNN's layout)."""
  return jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0]


def pallas_gqa_bf16(q, k, v):
  """jax's Pallas (Triton) decode kernel, fed its native layout: one kv head per row, k/v [B*K, S, H]."""
  from jax.experimental.pallas.ops.gpu import decode_attention as da  # pylint: disable=g-import-not-at-top
  b, n, h = q.shape
  o = da.mqa(q.reshape(b * KV_HEADS, n // KV_HEADS, h), k, v, k_splits=16, block_h=16, block_k=128)
  return o.reshape(b, n, h)


def quant_int8(x):
  scale = jnp.abs(x.astype(jnp.float32)).max(-1) / 127.0 + 1e-8
  return jnp.round(x / scale[..., None]).astype(jnp.int8), scale


def quant_fp8(x):
  scale = jnp.abs(x.astype(jnp.float32)).max(-1) / 448.0 + 1e-8
  return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def xla_scaled(q, kq, ks, vq, vs):
  """int8/fp8 cache with per-token scales [B, K, S]: dequantize inside the XLA einsums."""
  b, n, h = q.shape
  qg = q.reshape(b, KV_HEADS, n // KV_HEADS, h)
  s = jnp.einsum("BKGH,BKSH->BKGS", qg, kq.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  p = jax.nn.softmax(s * ks[:, :, None, :] * h**-0.5, axis=-1) * vs[:, :, None, :]
  return jnp.einsum("BKGS,BKSH->BKGH", p.astype(jnp.bfloat16), vq.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32).reshape(b, n, h)


def per_token_args(i, *, b, s, make):
  """The int8/fp8 rows' inputs in the cache's own layout ([B, S, K, H], scales [B, S, K]) for the Pallas kernel."""
  q, kq, ks, vq, vs = make(i)
  t = lambda x: jnp.swapaxes(x, 1, 2)
  return q, t(kq), t(vq), t(ks), t(vs), jnp.full((b,), s, jnp.int32)


def rel_l2(got: jax.Array, want: jax.Array) -> float:
  """‖got − want‖ / ‖want‖ over all elements in f32; inf where that is not finite (a NaN or Inf in got)."""
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  return rel if np.isfinite(rel) else float("inf")


def rel_err_vs(fn, ref, args) -> tuple[float, bool]:
  """(max |fn - ref| / max |ref|, whether fn's output has a NaN) for one set of arguments."""
  got = fn(*args).astype(jnp.float32)
  want = ref(*args).astype(jnp.float32)
  return float(jnp.abs(got - want).max() / jnp.abs(want).max()), bool(jnp.isnan(got).any())


def per_token_check(make_args, small_enough: bool) -> str:
  """The Pallas per-token kernel against its f32 reference on the GPU (a note for its row), where the reference's
  f32 dequantized cache fits."""
  if not small_enough:
    return "not checked (f32 reference too large)"
  try:
    err, nan = rel_err_vs(ptda.per_token_decode_attention, ptda.per_token_decode_attention_reference, make_args(0))
    return f"max rel err vs f32 reference {err:.2e}" + (", NaN" if nan else "")
  except Exception as e:  # pylint: disable=broad-except
    return f"check failed: {repr(e)[:200]}"


def quant_kivi2(k, v, group=128):
  """KIVI-2: keys per channel over groups of `group` tokens, values per token; 2-bit codes packed 4 per byte."""
  b, kh, s, h = k.shape
  kg = k.astype(jnp.float32).reshape(b, kh, s // group, group, h)
  kmin, kmax = kg.min(3), kg.max(3)
  kscale = (kmax - kmin) / 3 + 1e-8
  kc = jnp.clip(jnp.round((kg - kmin[:, :, :, None]) / kscale[:, :, :, None]), 0, 3).astype(jnp.uint8)
  vf = v.astype(jnp.float32)
  vmin, vmax = vf.min(-1), vf.max(-1)
  vscale = (vmax - vmin) / 3 + 1e-8
  vc = jnp.clip(jnp.round((vf - vmin[..., None]) / vscale[..., None]), 0, 3).astype(jnp.uint8)
  pack = lambda c: (c[..., 0::4] | c[..., 1::4] << 2 | c[..., 2::4] << 4 | c[..., 3::4] << 6)
  return (pack(kc.reshape(b, kh, s, h)), kscale.astype(jnp.bfloat16), kmin.astype(jnp.bfloat16),
          pack(vc), vscale.astype(jnp.bfloat16), vmin.astype(jnp.bfloat16))


def xla_kivi2(q, kc, kscale, kmin, vc, vscale, vmin, group=128):
  b, n, h = q.shape
  unpack = lambda c: ((c[..., None] >> jnp.array([0, 2, 4, 6], jnp.uint8)) & 3).reshape(*c.shape[:-1], 4 * c.shape[-1])
  s = kc.shape[2]
  kd = (unpack(kc).astype(jnp.bfloat16).reshape(b, KV_HEADS, s // group, group, h) * kscale[:, :, :, None]
        + kmin[:, :, :, None]).reshape(b, KV_HEADS, s, h)
  vd = unpack(vc).astype(jnp.bfloat16) * vscale[..., None] + vmin[..., None]
  return xla_bf16(q, kd, vd)


# ------------------------------------------------------------------------------------------------------- oskvp side


def oskvp_args(key, b, s, symmetric=False):
  return random_oskvp_inputs(key, batch=b, heads=N_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, capacity=s,
                             window=WINDOW, symmetric=symmetric)


def kernel_fn(cfg, symmetric=False):
  """The Pallas kernel at `cfg`, taking the 15 arguments (symmetric: two plane types, `OSKVPMode(symmetric=True)`)."""
  return lambda *a: _oskvp_pallas(*a, interpret=False, config=cfg, symmetric_codebooks=symmetric)


def oskvp_bytes(b, s):
  per_bk = 2 * (s * (HEAD_DIM // 4 + 8) + WINDOW * HEAD_DIM * 2 + HEAD_DIM * HEAD_DIM * 4 + HEAD_DIM * 16 + 32)
  return b * KV_HEADS * per_bk


QUICK_FORMS = ("mma", "bitplane")  # --quick checks, sweeps and times these (before, it timed mma unchecked)


def check_correctness(log, forms=("mma", "lut", "bitplane"), only=None):
  """Kernel vs reference on fresh random inputs; returns rows of (case, form, rel_err, nan)."""
  rows = []
  cases = [dict(batch=4, heads=16, kv_heads=4, head_dim=128, capacity=4097, window=128,
                n_comp=[1, 127, 1000, 4097], n_res=[0, 128, 77, 5]),
           dict(batch=2, heads=8, kv_heads=8, head_dim=64, capacity=1000, window=64, n_comp=[999, 3], n_res=[64, 1]),
           dict(batch=2, heads=16, kv_heads=2, head_dim=64, capacity=2048, window=128, n_comp=[2048, 0],
                n_res=[1, 128]),
           dict(batch=2, heads=8, kv_heads=8, head_dim=128, capacity=1000, window=64, n_comp=[999, 3], n_res=[64, 1]),
           dict(batch=2, heads=16, kv_heads=2, head_dim=128, capacity=2048, window=128, n_comp=[2048, 0],
                n_res=[1, 128])]
  for i, case in enumerate(cases):
    args = random_oskvp_inputs(jax.random.key(10 + i), **case)
    ref = jax.jit(oskvp_decode_attention_reference)(*args).astype(jnp.float32)
    for form in forms:
      if form == "bitplane" and case["head_dim"] < 128:
        continue  # needs H >= 128 (see oskvp_decode_attention_bitplane)
      cfgs = [DecodeBlockConfig(form=form), DecodeBlockConfig(form=form, block_s=32, num_splits=7)]
      if form == "bitplane":
        cfgs = only or [BITPLANE, PLAIN_ROWS,
                        dataclasses.replace(BITPLANE, block_s=32, num_splits=7, query_digits=1)]
      if form == "mma":
        cfgs.append(DecodeBlockConfig(block_s=128, num_splits=7, num_stages=2, outlier_mma=False, prefetch=True))
        cfgs.append(DecodeBlockConfig(decode="poly"))
      runs = [(cfg, args, ref, False) for cfg in cfgs]
      if form == "bitplane":  # symmetric codebooks, two plane types
        sargs = random_oskvp_inputs(jax.random.key(10 + i), symmetric=True, **case)
        sref = jax.jit(oskvp_decode_attention_reference)(*sargs).astype(jnp.float32)
        runs += [(cfg, sargs, sref, True) for cfg in cfgs[:2]]
      for cfg, a, r, sym in runs:
        try:
          out = _oskvp_pallas(*a, interpret=False, config=cfg, poison=True,
                              symmetric_codebooks=sym).astype(jnp.float32)
          err = float(jnp.linalg.norm(out - r) / jnp.linalg.norm(r))
          rows.append(dict(case=i, config=str(cfg), symmetric=sym, rel_err=err, nan=bool(jnp.isnan(out).any())))
        except Exception as e:  # pylint: disable=broad-except
          rows.append(dict(case=i, config=str(cfg), symmetric=sym, error=repr(e)[:400]))
          traceback.print_exc()
        log(f"check {rows[-1]}")
  return rows


def main():
  # Imported here: the wired path's helpers import this module's grid inputs (`oskvp_args`, `WINDOW`, `rel_l2`).
  from benchmarks import decode_attention_mosaic as mos  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/decode_attention")
  ap.add_argument("--contexts", default="4096,16384,65536,131072")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--skip_sweep", action="store_true")
  ap.add_argument("--sweep_only", action="store_true", help="stop after the tiling sweep (and cuDNN at 64k x 8)")
  ap.add_argument("--quick", action="store_true",
                  help="check and sweep only the bit-plane candidates and the mma default; no lut in the grid")
  ap.add_argument("--extras_contexts", default="65536", help="contexts for the slower/secondary peers")
  ap.add_argument("--max_cache_gb", type=float, default=40.0, help="skip bf16 peers whose K+V exceed this")
  ap.add_argument("--merge", default="", help="comma-separated decode_attention.json files to combine (no GPU)")
  ap.add_argument("--merge_add", default="",
                  help="with --merge: runs whose new implementations (and their cuDNN rows) are added to the cells")
  ap.add_argument("--mosaic_grid", action="store_true",
                  help="the grid of cuDNN, the Triton bit-plane defaults and the wired Mosaic GPU path of "
                       "oskvp_uniform only (no sweep, no secondary peers); checks the Mosaic path first")
  ap.add_argument("--mosaic_glue", default="auto",
                  help="comma-separated glues around the Mosaic core timed in --mosaic_grid "
                       "(uniform_decode_attention's glue=: auto, xla, pallas)")
  ap.add_argument("--span", action="store_true",
                  help="also trace each timed program once and report the GPU span per call (decode_timeline.py): "
                       "the wall clock adds the host's fixed cost of launching the program")
  ap.add_argument("--mosaic_only", action="store_true",
                  help="--mosaic_grid without the Triton bit-plane rows (the wired path and cuDNN only)")
  ap.add_argument("--mosaic_max_splits", default="auto",
                  help="comma-separated max_splits of the wired path timed in --mosaic_grid (auto: sized for B·K)")
  ap.add_argument("--mosaic_core", default="wgmma",
                  help="comma-separated cores of the wired path timed in --mosaic_grid (wgmma, mma (key_rows tokens), "
                       "mma:heads, mma:tokens)")
  ap.add_argument("--mosaic_output_rotation", default="xla",
                  help="comma-separated output rotations of the wired path in --mosaic_grid "
                       "(uniform_decode_attention's output_rotation=: xla, epilogue)")
  ap.add_argument("--mosaic_epilogue_channels", default="auto",
                  help="comma-separated output channels per epilogue program timed in --mosaic_grid "
                       "(uniform_decode_attention's epilogue_channels=: auto, 16, 32, 64, 128)")
  ap.add_argument("--mosaic_value_layout", default="blocks",
                  help="comma-separated value layouts of the wired path timed in --mosaic_grid (blocks: block-major, "
                       "what an oskvp_uniform cache stores at these capacities; tokens: [X, S])")
  ap.add_argument("--mosaic_query_rotation", default="xla",
                  help="comma-separated places of q U_k timed in --mosaic_grid (uniform_decode_attention's "
                       "query_rotation=: xla, prologue)")
  ap.add_argument("--mosaic_value_outliers", default="fp8_stacked",
                  help="comma-separated value-outlier forms of the core timed in --mosaic_grid (fp8, fp8_stacked, f16)")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if args.merge:
    return write_merged(args.merge.split(","), args.out, [p for p in args.merge_add.split(",") if p])
  logf = open(os.path.join(args.out, "log.txt"), "w")

  def log(msg):
    print(msg, flush=True)
    logf.write(msg + "\n")
    logf.flush()

  dev = jax.devices()[0]
  log(f"device {dev.device_kind}, jax {jax.__version__}")
  copy_tbs, read_tbs = copy_bandwidth()
  log(f"copy bandwidth {copy_tbs:.2f} TB/s (x+1, f32, read+write), read-only sum {read_tbs:.2f} TB/s")
  copy_span_tbs = read_span_tbs = None
  if args.span:
    copy_span_tbs, read_span_tbs = copy_bandwidth_span()
    if copy_span_tbs:
      log(f"by GPU span: copy {copy_span_tbs:.2f} TB/s, read-only sum {read_span_tbs:.2f} TB/s")
  if args.mosaic_grid:
    checks = [c for glue, form, core, rot, orot, hc, vlay in itertools.product(
                  args.mosaic_glue.split(","), args.mosaic_value_outliers.split(","), args.mosaic_core.split(","),
                  args.mosaic_query_rotation.split(","), args.mosaic_output_rotation.split(","),
                  args.mosaic_epilogue_channels.split(","), args.mosaic_value_layout.split(","))
              if mos.rotation_applies(glue, rot, orot) and mos.channels_apply(glue, orot, hc)
              for c in mos.check_mosaic_uniform(log, glue, form, core, rot, orot, hc, vlay)]
    if not all(c.get("rel_err", 1.0) < 0.03 and not c["nan"] for c in checks):
      log("the Mosaic path failed its check; stopping before the timings")
      return 1
    checks += check_correctness(log, ("bitplane",), only=[BITPLANE])
    args.skip_sweep, args.extras_contexts = True, ""
  elif args.sweep_only:  # Eighth run: f16 outliers and masked value planes on top of compact rows.
    checks = check_correctness(log, ("bitplane",),
                               only=[BITPLANE, dataclasses.replace(BITPLANE, block_s=32, num_splits=7)])
  else:
    checks = check_correctness(log, QUICK_FORMS if args.quick else ("mma", "lut", "bitplane"))
  checked = ("bitplane",) if args.sweep_only else QUICK_FORMS if args.quick else ("mma", "lut", "bitplane")
  ran = {form for form in checked for c in checks if "rel_err" in c and f"form='{form}'" in c["config"]}
  if not args.mosaic_grid and ran != set(checked):  # (a bare "mma" test matched every config's outlier_mma=)
    log(f"the {sorted(set(checked) - ran)} kernels did not run; stopping before the timings")
    return 1

  # Tiling sweep at 64k x 8.
  sweep = []
  best = {"mma": DecodeBlockConfig(), "lut": DecodeBlockConfig(form="lut"), "bitplane": BITPLANE}
  if not args.skip_sweep:
    b, s = 8, 65536
    nbytes = oskvp_bytes(b, s)
    # First run (2026-11-30): block 128 / 4 warps / 2 stages / broadcast outliers best (1.36 ms); splits 8, 32 and
    # the default within 3%; 8 warps, 3 stages and block 256 slower; lut 3.5x slower. The SASS (see
    # decode_attention_sass.py) showed that configuration spilling; this sweep times the non-spilling candidates.
    timed_first = DecodeBlockConfig(block_s=128, num_stages=2, outlier_mma=False)
    cfgs = [timed_first, DecodeBlockConfig(), DecodeBlockConfig(num_stages=2),
            DecodeBlockConfig(block_s=32),
            DecodeBlockConfig(block_s=32, num_stages=2), DecodeBlockConfig(block_s=128),
            DecodeBlockConfig(num_warps=8), DecodeBlockConfig(prefetch=True), DecodeBlockConfig(decode="poly"),
            DecodeBlockConfig(block_s=32, decode="poly"), DecodeBlockConfig(form="lut", block_s=32)]
    bitplane = functools.partial(DecodeBlockConfig, form="bitplane")
    # Second run (one kv head per program, 2 query digits): block 128 / 1 stage best, 0.79 ms; 2 stages, 2 warps,
    # block 32 and the jnp plane extraction slower. Third: heads sharing the 16 rows, one query digit.
    # The third (heads sharing rows) spent its minutes compiling 8 unrolled heads; see the notes.
    bp = lambda **k: bitplane(num_stages=1, **k)
    cfgs += [bp(block_s=128), bp(block_s=128, query_digits=1), bp(block_s=64), bp(block_s=64, query_digits=1),
             bp(block_s=64, heads_per_program=2, query_digits=1)]
    cfgs = [(c, False) for c in cfgs]
    if args.sweep_only:
      # Fifth run (64k x 8; cuDNN 0.566 ms): block 128 0.765 ms; prefetch 0.930; block 256 0.650; 2 stages 0.889;
      # 8 warps 1.170; 16 splits 0.750. Sixth: around block 256 (block 512 1.043, 16 splits 0.622). Eighth: the
      # compact default against f16 outliers + masked value planes (35.0 -> 33.4 instructions per token-head).
      # BITPLANE has both since; the first candidate is compact rows alone (run 7's default).
      compact = dataclasses.replace(BITPLANE, outlier_f16=False, masked_value_planes=False)
      cfgs = [(c, sym) for sym in (False, True)
              for c in (compact, BITPLANE, dataclasses.replace(BITPLANE, num_splits=16))]
    if args.quick:  # The bit-plane default, symmetric codebooks, compact rows and their nearest rivals.
      # Seventh run (decode_attention_run7.log, 64k x 8, cuDNN 0.534 ms): compact rows 0.545 (0.491 symmetric),
      # plain rows 0.718 (0.575 symmetric); block 128, 8 warps and 16 splits slower. Compact rows is now BITPLANE.
      compact, plain = BITPLANE, PLAIN_ROWS
      cfgs = [(plain, False), (plain, True), (compact, False), (compact, True),
              (dataclasses.replace(compact, block_s=128), True), (dataclasses.replace(compact, num_warps=8), True),
              (dataclasses.replace(compact, num_splits=16), True), (dataclasses.replace(compact, block_s=128), False),
              (DecodeBlockConfig(), False)]
      best.pop("lut")
    best_ms = {}
    for cfg, sym in cfgs:
      try:
        # --sweep_only times like the grid (and like its cuDNN row): 15 reps, >= 8 calls per dispatch.
        ms = timeit(kernel_fn(cfg, sym), lambda i, sym=sym: oskvp_args(jax.random.key(i), b, s, sym), nbytes,
                    reps=15 if args.sweep_only else 10, min_calls=8 if args.sweep_only else 4)
      except Exception as e:  # pylint: disable=broad-except
        log(f"sweep {cfg} symmetric={sym} failed: {repr(e)[:300]}")
        continue
      sweep.append(dict(config=str(cfg), symmetric=sym, ms=ms, tb_per_s=nbytes / ms / 1e9))
      log(f"sweep {cfg} symmetric={sym}: {ms:.4f} ms, {nbytes / ms / 1e9:.2f} TB/s")
      key = cfg.form + ("_compact" if cfg.compact_rows else "") + ("_sym" if sym else "")
      if ms < best_ms.get(key, 1e9):
        best_ms[key], best[key] = ms, cfg
    if args.quick:
      best.pop("bitplane_sym", None)  # in the sweep only; the grid times the compact forms with and without
    log(f"best: {best}")
    if args.sweep_only:
      ms = timeit(cudnn_bf16, lambda i: (jax.random.normal(jax.random.key(i), (b, N_HEADS, HEAD_DIM), jnp.bfloat16),
                                         *[x.transpose(0, 2, 1, 3) for x in bf16_cache(jax.random.key(i), b, s)]),
                  2 * b * KV_HEADS * s * HEAD_DIM * 2)
      log(f"cudnn_bf16 B={b} S={s}: {ms:.4f} ms")
      with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(dict(sweep=sweep, checks=checks, cudnn_ms=ms, copy_tb_per_s=copy_tbs), f, indent=1)
      return 0

  # The final defaults only, with and without symmetric codebooks.
  if (args.quick and args.skip_sweep) or args.mosaic_grid:
    best = {"bitplane": BITPLANE, "bitplane_sym": BITPLANE}
  if args.mosaic_grid and args.mosaic_only:
    best = {}
  rows = []
  meta = dict(device=dev.device_kind, jax=jax.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(),
              shapes=dict(n_heads=N_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, window=WINDOW, outliers=8),
              copy_tb_per_s=copy_tbs, read_tb_per_s=read_tbs, best_configs={k: str(v) for k, v in best.items()})
  if copy_span_tbs:
    meta.update(copy_span_tb_per_s=copy_span_tbs, read_span_tb_per_s=read_span_tbs)
  result = dict(meta=meta, checks=checks, sweep=sweep, rows=rows)

  def save():
    with open(os.path.join(args.out, "decode_attention.json"), "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "decode_attention.md"), "w") as f:
      f.write(render_md(result))

  save()

  def record(impl, b, s, ms, nbytes, note="", span_ms=None):
    row = timing_row(impl, b, s, ms, nbytes, copy_tbs, note=note, span_ms=span_ms, copy_span_tbs=copy_span_tbs)
    rows.append(row)
    save()
    span = "" if span_ms is None else f" (GPU span {span_ms:.4f} ms)"
    log(f"{impl:24s} B={b:3d} S={s:7d} {ms:8.4f} ms {row['tb_per_s']:6.2f} TB/s{span} {note}")

  def gpu_span_ms(chained):
    from benchmarks.decode_timeline import trace_chained  # pylint: disable=g-import-not-at-top
    tl = trace_chained(chained)
    return tl["span_us"] * 1e-3 if "span_us" in tl else None

  def attempt(impl, b, s, fn, make_args, nbytes, note=""):
    try:
      chained = chained_calls(fn, make_args, nbytes)  # one program for both clocks
      span = gpu_span_ms(chained) if args.span else None
      record(impl, b, s, timeit(fn, make_args, nbytes, chained=chained), nbytes, note, span)
    except Exception as e:  # pylint: disable=broad-except
      log(f"{impl} B={b} S={s} failed: {repr(e)[:300]}")

  for s in [int(x) for x in args.contexts.split(",")]:
    for b in [int(x) for x in args.batches.split(",")]:
      bf_bytes = 2 * b * KV_HEADS * s * HEAD_DIM * 2
      q_of = lambda i, b=b: jax.random.normal(jax.random.key(i), (b, N_HEADS, HEAD_DIM), jnp.bfloat16)
      for form, cfg in best.items():
        cfg = dataclasses.replace(cfg, num_splits=None)  # splits sized per shape (the sweep is at batch 8 only)
        sym = form.endswith("_sym")
        attempt(f"oskvp_pallas_{form}", b, s, kernel_fn(cfg, sym),
                lambda i, sym=sym: oskvp_args(jax.random.key(i), b, s, sym), oskvp_bytes(b, s), str(cfg))
      if args.mosaic_grid:
        for glue, form, ms, core, rot, orot, hc, vlay in itertools.product(
            args.mosaic_glue.split(","), args.mosaic_value_outliers.split(","), args.mosaic_max_splits.split(","),
            args.mosaic_core.split(","), args.mosaic_query_rotation.split(","),
            args.mosaic_output_rotation.split(","), args.mosaic_epilogue_channels.split(","),
            args.mosaic_value_layout.split(",")):
          if not (mos.rotation_applies(glue, rot, orot) and mos.channels_apply(glue, orot, hc)):
            continue
          attempt("oskvp_mosaic_uniform" + ("" if glue == "auto" else f"_{glue}_glue")
                  + ("" if form == "fp8_stacked" else f"_{form}") + ("" if ms == "auto" else f"_s{ms}")
                  + mos.mosaic_core_label(core) + mos.rotation_label(rot, orot)
                  + ("" if hc == "auto" else f"_e{hc}") + mos.value_layout_label(vlay), b, s,
                  functools.partial(mos.mosaic_uniform, glue=glue, value_outliers=form,
                                    max_splits=None if ms == "auto" else int(ms), core=core, query_rotation=rot,
                                    output_rotation=orot, epilogue_channels=mos.channels_arg(hc)),
                  lambda i, vlay=vlay: mos.uniform_args(jax.random.key(i), b, s, vlay), oskvp_bytes(b, s),
                  f"Mosaic GPU core + window (kv_cache='oskvp_uniform'), glue={glue}, value_outliers={form}, "
                  f"max_splits={ms}, core={core}, query_rotation={rot}, output_rotation={orot}, "
                  f"epilogue_channels={hc}, value_layout={vlay}")
      extras = str(s) in args.extras_contexts.split(",")
      if extras and 2 * b * KV_HEADS * s * HEAD_DIM * 4 * 3 < args.max_cache_gb * 1e9:  # its f32 dequantized K, V, scores
        attempt("oskvp_xla_reference", b, s, oskvp_decode_attention_reference,
                lambda i: oskvp_args(jax.random.key(i), b, s), oskvp_bytes(b, s))
      if bf_bytes > args.max_cache_gb * 1e9:
        log(f"skip bf16 peers at B={b} S={s}: K+V {bf_bytes / 1e9:.1f} GB > {args.max_cache_gb} GB")
        continue

      def kv_bshk(i):
        k, v = bf16_cache(jax.random.key(i), b, s)
        return (q_of(i), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))

      def kv_bksh(i):
        return (q_of(i), *bf16_cache(jax.random.key(i), b, s))

      def kv_rows(i):
        k, v = bf16_cache(jax.random.key(i), b, s)
        return (q_of(i), k.reshape(b * KV_HEADS, s, HEAD_DIM), v.reshape(b * KV_HEADS, s, HEAD_DIM))

      attempt("cudnn_bf16", b, s, cudnn_bf16, kv_bshk, bf_bytes)
      if args.mosaic_grid:
        continue
      attempt("xla_bf16", b, s, xla_bf16, kv_bksh, bf_bytes)
      if not extras:
        continue
      attempt("jax_pallas_decode_bf16", b, s, pallas_gqa_bf16, kv_rows, bf_bytes, "mqa over B*K rows")

      def int8_args(i, quant=quant_int8):
        _, k, v = kv_bksh(i)
        kq, ks = quant(k)
        vq, vs = quant(v)
        return (q_of(i), kq, ks, vq, vs)

      scaled_bytes = 2 * b * KV_HEADS * s * (HEAD_DIM + 4)
      attempt("xla_int8", b, s, xla_scaled, int8_args, scaled_bytes)
      attempt("xla_fp8", b, s, xla_scaled, lambda i: int8_args(i, quant_fp8), scaled_bytes)
      for name, quant in (("int8", quant_int8), ("fp8", quant_fp8)):
        args_fn = functools.partial(per_token_args, b=b, s=s, make=functools.partial(int8_args, quant=quant))
        attempt(f"pallas_{name}", b, s, ptda.per_token_decode_attention, args_fn, scaled_bytes,
                per_token_check(args_fn, 2 * b * KV_HEADS * s * HEAD_DIM * 4 * 3 < args.max_cache_gb * 1e9))
      kivi_bytes = b * KV_HEADS * (2 * s * HEAD_DIM // 4 + (s // 128) * HEAD_DIM * 4 + s * 4)
      attempt("xla_kivi2", b, s, xla_kivi2, lambda i: (q_of(i), *quant_kivi2(*kv_bksh(i)[1:])), kivi_bytes)

  save()
  print(render_md(result))


def merge_runs(results: list[dict], labels: list[str], added: tuple[bool, ...] = ()) -> dict:
  """One result from several runs': each (context, batch) cell comes whole from the last run that timed it.

  A run marked in `added` (by position) replaces none of those: its rows of implementations no unmarked run has are
  added to their cells, with its own cuDNN rows to be compared against; where a later added run times the same
  implementation in a cell, its row replaces the earlier one (and the earlier run's cuDNN row there goes too, unless
  that run still has other rows in the cell). Rows gain "run" (its label); meta becomes {"runs": [each run's meta
  with its label]}; the checks of every run are kept, labelled; sweeps are dropped (they live in the runs' own
  files).
  """
  added = tuple(added) + (False,) * (len(results) - len(added))
  cells, checks, metas = {}, [], []
  base = {r["impl"] for result, add in zip(results, added) if not add for r in result["rows"]}
  new_rows, cudnn_rows, timed = {}, [], set()  # (impl, context, batch) -> the last added run's row
  for label, result, add in zip(labels, results, added):
    metas.append(dict(result["meta"], run=label, added=add))
    checks += [dict(c, run=label) for c in result["checks"]]
    if add:
      for r in result["rows"]:
        if r["impl"] == "cudnn_bf16":
          cudnn_rows.append(dict(r, run=label))
        elif r["impl"] not in base:
          new_rows[(r["impl"], r["context"], r["batch"])] = dict(r, run=label)
          timed.add((label, r["context"], r["batch"]))
      continue
    for cell in {(r["context"], r["batch"]) for r in result["rows"]}:
      cells[cell] = [dict(r, run=label) for r in result["rows"] if (r["context"], r["batch"]) == cell]
  live = {(r["run"], r["context"], r["batch"]) for r in new_rows.values()}
  extra = list(new_rows.values()) + [r for r in cudnn_rows if (key := (r["run"], r["context"], r["batch"])) in live
                                     or key not in timed]
  rows = [r for cell in sorted(cells) for r in cells[cell]] + extra
  return dict(meta=dict(runs=metas), checks=checks, sweep=[], rows=rows)


def write_merged(paths: list[str], out: str, added_paths: list[str] = ()) -> int:
  results = []
  for path in [*paths, *added_paths]:
    with open(path) as f:
      results.append(json.load(f))
  labels = [os.path.basename(p).removesuffix(".json").removeprefix("decode_attention_") for p in [*paths, *added_paths]]
  merged = merge_runs(results, labels, (False,) * len(paths) + (True,) * len(added_paths))
  with open(os.path.join(out, "decode_attention.json"), "w") as f:
    json.dump(merged, f, indent=1)
  with open(os.path.join(out, "decode_attention.md"), "w") as f:
    f.write(render_md(merged, sources=[*paths, *added_paths]))
  return 0


def _span_copy(meta) -> str:
  if not meta.get("copy_span_tb_per_s"):
    return ""
  return (f"; by GPU span (the clock of the span rows) copy {meta['copy_span_tb_per_s']:.2f} TB/s, read-only "
          f"{meta['read_span_tb_per_s']:.2f} TB/s")


def _run_header(meta) -> str:
  return (f"{meta['device']}, jax {meta['jax']}, {meta['date'][:16]} UTC; copy bandwidth {meta['copy_tb_per_s']:.2f} "
          f"TB/s (f32 x+1, read+write), read-only {meta['read_tb_per_s']:.2f} TB/s" + _span_copy(meta))


def render_md(result, sources=None):
  meta, rows = result["meta"], result["rows"]
  runs = meta.get("runs")
  first = runs[0] if runs else meta
  head = [f"# Decode attention, {first['device']}, jax {first['jax']}" +
          (f", {len(runs)} runs" if runs else f", {meta['date'][:16]} UTC"), "",
          f"N={first['shapes']['n_heads']} query / K={first['shapes']['kv_heads']} kv heads, H=128; OS-KVP: 2-bit "
          f"codes + 8 fp8 outliers, residual window {first['shapes']['window']}."]
  if runs:
    head += ["Each context x batch comes whole from one run, except that an added run's new implementations join the "
             "cells with that run's own cuDNN rows; \"of copy BW\" and \"vs cuDNN\" use each row's own run.", ""]
    head += [f"- {m['run']}{' (added)' if m.get('added') else ''} (`{os.path.basename(src)}`): {_run_header(m)}; "
             f"OS-KVP configs {m['best_configs']}" for m, src in zip(runs, sources or [""] * len(runs))]
  else:
    head += [f"Copy bandwidth in this run: {meta['copy_tb_per_s']:.2f} TB/s (f32 x+1, read+write), read-only "
             f"{meta['read_tb_per_s']:.2f} TB/s{_span_copy(meta)}.", f"Best tilings: {meta['best_configs']}"]
  run_col = lambda r: f" {r['run']} |" if runs else ""
  spans = any("span_ms" in r for r in rows)
  span_copy = any("frac_copy_bw_span" in r for r in rows)  # the span's rate over the copy timed by span
  if span_copy:
    head += ["", "\"of copy BW\" divides the wall-clock rate by the wall-clock copy; \"span of copy\" the GPU span's "
             "rate by the copy timed by GPU span."]
  out = head + ["", "| impl | batch | context | ms | bytes read | TB/s | of copy BW | vs cuDNN |" +
                (" GPU span ms | span vs cuDNN |" if spans else "") + (" span of copy |" if span_copy else "") +
                (" run |" if runs else ""),
                "|---|---|---|---|---|---|---|---|" + ("---|---|" if spans else "") + ("---|" if span_copy else "") +
                ("---|" if runs else "")]
  cud = {(r.get("run"), r["batch"], r["context"]): r for r in rows if r["impl"] == "cudnn_bf16"}
  ratio = lambda ref, r, key: f" {ref[key] / r[key]:.2f}x |" if ref and ref.get(key) and r.get(key) else " - |"

  def span_cols(r, ref):
    cols = (f" {r['span_ms']:.4f} |" if r.get("span_ms") else " - |") + ratio(ref, r, "span_ms") if spans else ""
    if span_copy:
      cols += f" {100 * r['frac_copy_bw_span']:.0f}% |" if "frac_copy_bw_span" in r else " - |"
    return cols

  for r in sorted(rows, key=lambda r: (r["context"], r["batch"], r["ms"])):
    ref = cud.get((r.get("run"), r["batch"], r["context"]))  # the row's own run
    out.append(f"| {r['impl']} | {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['bytes_read'] / 1e6:.1f} MB | "
               f"{r['tb_per_s']:.2f} | {100 * r['frac_copy_bw']:.0f}% |" + ratio(ref, r, "ms") + span_cols(r, ref) +
               run_col(r))
  if result["sweep"]:
    out += ["", "Tiling sweep at 64k x batch 8 (OS-KVP Pallas):", "", "| config | ms | TB/s |", "|---|---|---|"]
    sym = lambda r: " (symmetric codebooks)" if r.get("symmetric") else ""
    out += [f"| {r['config']}{sym(r)} | {r['ms']:.4f} | {r['tb_per_s']:.2f} |" for r in sorted(result["sweep"],
                                                                                          key=lambda r: r["ms"])]
  out += ["", "Correctness on the GPU (relative L2 error vs the jnp reference, poisoned partials):", ""]
  def check_line(c):
    outcome = f"rel_err {c['rel_err']:.2e}, nan={c['nan']}" if "rel_err" in c else f"ERROR {c['error'][:200]}"
    run = f"{c['run']} " if "run" in c else ""
    return f"- {run}case {c['case']} {c['config']}{' symmetric' if c.get('symmetric') else ''}: {outcome}"

  out += [check_line(c) for c in result["checks"]]
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  sys.exit(main())
