"""The fused Mosaic GPU OS-KVP core (uniform codebooks) on the H200: checks, then time next to cuDNN and our kernel.

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/oskvp_decode_core_mgpu_bench.py --out=$OUT
CPU smoke test:   PYTHONPATH=$PWD python3 benchmarks/oskvp_decode_core_mgpu_bench.py --smoke --out=/tmp/core_smoke

1. Checks: `decode_core_mgpu` (GPU route: planes in registers, p stored by hand) against its blockwise XLA model
   (`decode_core_blockwise_reference`, the same quantized arithmetic; max abs error <= 1e-3 on outputs in [0, 3])
   at a few shapes, and the error of both against the exact softmax (`decode_core_reference`) for the record.
2. Timing (CUPTI kernel time, L2 flushed, median of --iters), in one call: the core at BK = 64 (batch 8 × 8 kv
   heads), S = 65536 and 16384 (splits, block 64/128); next to it, at batch 8 with 32 query heads, 8 kv heads,
   H = 128 and the same S: `jax.nn.dot_product_attention(implementation="cudnn")` on a bf16 cache and our Triton
   OS-KVP kernel (`BITPLANE`, symmetric codebooks: its two-plane-type path, which uniform codebooks also take).
   The core reads only the K and V codes (64 bytes per token-head); the Triton kernel reads the whole cache (codes,
   fp8 outlier channels, residual window, U): the table gives both byte counts.
3. Writes oskvp_decode_core_mgpu.{md,json} under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import oskvp_key_scores_mgpu_bench as kb
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels.oskvp_random import uniform_codebooks

Q = 32  # H = 128
BK = 64  # batch 8 × 8 kv heads
# BK, S, block_s, splits, ring, lengths (None: all S, no masking)
# BK, S, block_s, splits, ring, lengths (None: all S, no masking), fp8 outlier channels
CHECKS = [(2, 1024, 64, 2, 2, None, False), (3, 3072, 128, 3, 2, None, False), (2, 4096, 64, 4, 4, None, False),
          (1, 8192, 128, 1, 8, None, False), (4, 4096, 128, 2, 2, (1, 127, 1000, 4096), False),
          (2, 2048, 64, 2, 2, None, True), (4, 4096, 128, 2, 2, (1, 127, 1000, 4096), True),
          (2, 2048, 64, 2, 2, None, "f16"), (4, 4096, 128, 2, 2, (1, 127, 1000, 4096), "f16"),
          (2, 2048, 64, 2, 2, None, "fp8_stacked"), (4, 4096, 128, 2, 2, (1, 127, 1000, 4096), "fp8_stacked"),
          # block 256: two 128-token passes per pipeline step (twenty-second session)
          (2, 2048, 256, 2, 2, None, False), (4, 4096, 256, 2, 2, (1, 127, 1000, 4096), False),
          (2, 2048, 256, 2, 2, None, "fp8_stacked"), (4, 4096, 256, 2, 2, (1, 127, 1000, 4096), "fp8_stacked"),
          (2, 8192, 256, 1, 4, (300, 8192), "fp8_stacked")]
SMOKE_CHECKS = [(2, 256, 64, 2, 2, (1, 200), False), (2, 256, 64, 2, 2, (1, 200), True),
                (2, 256, 64, 2, 2, (1, 200), "f16"), (2, 256, 64, 2, 2, (1, 200), "fp8_stacked")]
# S, block_s, splits, TMA ring depth, ablation. Run 2 (results/oskvp_decode_core_mgpu.md): bs 128, 16 splits, ring 2
# best; run 3 repeated it (_run3.md). Ablations (wrong results, timing only) show what each part costs.
# "ragged" times the masking work with every row full.
# Runs 4-6 timed the ablations ("no_max", "no_value"; results/oskvp_decode_core_mgpu_run4.md, _run6.md).
# "outliers" adds the fp8 outlier channels (16 bytes per token-head more). Run 7 timed them with the f16 A tiles
# stored transposed in shared memory (165 µs vs 101 without, bs 128); run 8 with the A operands built in registers
# from key [S, 8] and token-contiguous value [8, S] tiles (ring 2 and 3).
# Run 11 (ninth session) added the fp8 form of the value-outlier sums ("+f16" is the form of runs 8-10); run 12
# found it best at ring 2 (151 µs) and the f16 form at ring 3 (159 µs). Run 13 (tenth session) timed "+fp8_stacked"
# (both e4m3 parts in one A tile: one wgmma, 8 KB less shared memory per program): 145.5 µs at ring 2, the core's
# default since. Rows without a "+form" suffix run the "fp8" form.
TIMED = [(65536, 128, 16, 2, "outliers"), (65536, 128, 16, 2, "outliers+fp8_stacked"),
         (65536, 128, 16, 3, "outliers"), (65536, 128, 16, 3, "outliers+fp8_stacked"),
         (65536, 128, 16, 3, "outliers+f16"), (65536, 128, 16, 2, "outliers+ragged"),
         (65536, 128, 16, 2, "outliers+no_outlier_value"), (65536, 128, 16, 2, "outliers+no_outlier_key"),
         (65536, 128, 16, 2, ""), (16384, 128, 16, 2, "outliers"), (16384, 128, 16, 2, "outliers+fp8_stacked")]


def inputs(seed: int, bk: int, s: int, g: int = 4, scale: float = 0.004):
  """Random codes and query digits (G heads of 8 used), scale in base-2 logits per integer score unit."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  kc = jax.random.bits(k1, (bk, s, Q), jnp.uint8)
  vc = jax.random.bits(k2, (bk, Q, s), jnp.uint8)
  qd = jax.random.randint(k3, (bk, dc.N, 4 * Q), -127, 128).astype(jnp.int8).at[:, g:].set(0)
  return kc, vc, qd, jnp.full((bk, dc.N), scale, jnp.float32)


def core_fn(block_s: int, splits: int, steps: int, interpret: bool, ablate: str = "", value_outliers: str = "fp8"):
  return jax.jit(lambda *a: dc.decode_core_mgpu(*a, block_s=block_s, splits=splits, max_concurrent_steps=steps,
                                                interpret=interpret, ablate=ablate, value_outliers=value_outliers))


def outlier_inputs(seed: int, bk: int, s: int, g: int = 4):
  """fp8 key outliers [BK, S, 8], value outliers [BK, 8, S] (tokens contiguous) and the key-outlier query f16
  [BK, 8, 8]."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  kout = (jax.random.normal(k1, (bk, s, dc.OUTLIERS)) * 2).astype(jnp.float8_e4m3fn)
  vout = (jax.random.normal(k2, (bk, dc.OUTLIERS, s)) * 2).astype(jnp.float8_e4m3fn)
  qo = (jax.random.normal(k3, (bk, dc.N, dc.OUTLIERS)) * 0.3).at[:, g:].set(0).astype(jnp.float16)
  return kout, vout, qo


def core_args(s: int, variant: str):
  """The timed inputs at BK = 64; "ragged" adds full lengths (the masking work without fewer tokens), "outliers"
  the fp8 outlier channels."""
  args = inputs(0, BK, s)
  lengths = jnp.full((BK,), s, jnp.int32) if "ragged" in variant else None
  return (*args, lengths, *outlier_inputs(1, BK, s)) if "outliers" in variant else (*args, lengths)


def timed_bytes(s: int, variant: str) -> int:
  return BK * s * (2 * Q + (16 if "outliers" in variant else 0))


def run_check(case, interpret: bool) -> dict:
  bk, s, block_s, splits, steps, lengths, outliers = case  # outliers: False, True (fp8 value form) or a form
  args = (*inputs(bk * s + splits, bk, s), None if lengths is None else jnp.asarray(lengths, jnp.int32))
  if outliers:
    args = (*args, *outlier_inputs(bk + s, bk, s))
  row = dict(bk=bk, s=s, block_s=block_s, splits=splits, ring=steps, lengths=lengths, outliers=outliers)
  flat = lambda x: np.concatenate([np.asarray(a)[:, :4].ravel() for a in (x if isinstance(x, tuple) else (x,))])
  try:
    got = flat(core_fn(block_s, splits, steps, interpret,
                       value_outliers=outliers if isinstance(outliers, str) else "fp8")(*args))
  except Exception as e:  # pylint: disable=broad-except
    return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
  model = flat(dc.decode_core_blockwise_reference(*args, block_s=block_s, splits=splits))
  exact = flat(dc.decode_core_reference(*args))
  err = float(np.abs(got - model).max())
  return {**row, "ok": bool(err <= 1e-3 and np.isfinite(got).all()), "max_abs_err_vs_model": err,
          "max_abs_err_vs_exact_softmax": float(np.abs(got - exact).max()),
          "model_vs_exact": float(np.abs(model - exact).max())}


def glue_inputs(seed: int, bk: int, s: int, g: int = 4):
  """Rotated queries, random codes and uniform codebooks, ragged lengths, fp8 outliers: `attend_codes`'s arguments."""
  ks_ = jax.random.split(jax.random.key(seed), 4)
  q_rot = jax.random.normal(ks_[0], (bk, g, 4 * Q), jnp.float32)
  kc = jax.random.bits(ks_[1], (bk, s, Q), jnp.uint8)
  vc = jax.random.bits(ks_[2], (bk, Q, s), jnp.uint8)
  cb = uniform_codebooks(ks_[3], (2, bk, 4 * Q))  # [2, BK, H, 4]
  lengths = jnp.maximum(s - jnp.arange(bk, dtype=jnp.int32) * (s // (2 * bk)), 1)
  ko, vo = jax.random.split(jax.random.fold_in(ks_[0], 1))
  outliers = ((jax.random.normal(ko, (bk, s, dc.OUTLIERS)) * 2).astype(jnp.float8_e4m3fn),
              jnp.full((bk, dc.OUTLIERS), 0.5, jnp.float32),
              (jax.random.normal(vo, (bk, dc.OUTLIERS, s)) * 2).astype(jnp.float8_e4m3fn),  # tokens contiguous
              jnp.full((bk, dc.OUTLIERS), 0.5, jnp.float32))
  return q_rot, kc, vc, cb[0], cb[1], lengths, outliers


def glue_fn(implementation: str, interpret: bool, **kw):
  from moe_jax.kv_quant import oskvp_uniform_codes as uc  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda *a: uc.attend_codes(*a, scale=(4 * Q)**-0.5, implementation=implementation,
                                            interpret=interpret, **kw))


def glue_check(smoke: bool) -> dict:
  """`attend_codes` through the core vs its exact XLA path: relative error of the outputs and the log-sum-exp."""
  bk, s, kw = (2, 256, dict(splits=1)) if smoke else (8, 8192, dict(splits=16))
  args = glue_inputs(5, bk, s)
  o1, l1 = glue_fn("pallas", smoke, **kw)(*args)
  o2, l2 = glue_fn("xla", smoke)(*args)
  rel = float(jnp.linalg.norm(o1 - o2) / jnp.linalg.norm(o2))
  lse = float(jnp.abs(l1 - l2).max())
  return dict(bk=bk, s=s, rel_err=rel, lse2_max_abs_err=lse, ok=bool(rel < 0.03 and lse < 0.05))


def peers(s: int, iters: int, smoke: bool) -> list[dict]:
  """cuDNN bf16 and our Triton OS-KVP kernel at batch 8, 32 heads, 8 kv heads, H = 128, context s."""
  from benchmarks import decode_attention as da  # pylint: disable=g-import-not-at-top
  rows = []
  b = 8
  q = jax.random.normal(jax.random.key(1), (b, da.N_HEADS, da.HEAD_DIM), jnp.bfloat16)
  k, v = (jax.random.normal(jax.random.key(i), (b, s, da.KV_HEADS, da.HEAD_DIM), jnp.bfloat16) for i in (2, 3))
  for name, fn, args, nbytes in [
      ("cudnn_bf16", jax.jit(da.cudnn_bf16), (q, k, v), 2 * k.nbytes),
      ("triton_oskvp_sym", jax.jit(da.kernel_fn(da.BITPLANE, symmetric=True)),
       da.oskvp_args(jax.random.key(4), b, s, symmetric=True), da.oskvp_bytes(b, s))]:
    if smoke:
      continue
    try:
      ms, kernels, _ = kb.kernel_ms(fn, args, iters, smoke)
      rows.append(dict(impl=name, s=s, us=ms * 1e3, bytes=nbytes, tb_per_s=nbytes / ms / 1e9, kernels=kernels))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(impl=name, s=s, error=f"{type(e).__name__}: {str(e)[:400]}"))
    print("peer", json.dumps(rows[-1]), flush=True)
  del k, v
  return rows


def write_report(out_dir: str, meta: dict, checks: list, rows: list, peer_rows: list) -> None:
  with open(os.path.join(out_dir, "oskvp_decode_core_mgpu.json"), "w") as fh:
    json.dump({**meta, "checks": checks, "rows": rows, "peers": peer_rows}, fh, indent=1)
  md = [f"# Fused Mosaic GPU OS-KVP core (uniform codebooks): {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
        f"Mode: {meta['mode']}. CUPTI kernel time, median of {meta['iters']}, L2 flushed. `cycles/token-head` = µs · "
        f"{meta['mhz']:.0f} MHz · {meta['sms']} SMs / (BK · S); the 0.108 ms target (5× cuDNN's 0.54 ms at 64k × 8) "
        f"leaves {kb.TARGET_CYCLES}.", "", "## Checks (GPU route vs the blockwise XLA model, max abs error ≤ 1e-3)", ""]
  for c in checks:
    if "rel_err" in c:  # the attend_codes check
      md.append(f"- {'ok' if c['ok'] else 'MISMATCH'} attend_codes (ragged lengths, uniform codebooks, outliers) BK={c['bk']} "
                f"S={c['s']}: relative error vs its exact XLA path {c['rel_err']:.2e} (limit 3e-2), log2-sum-exp "
                f"max abs error {c['lse2_max_abs_err']:.2e} (limit 5e-2)")
      continue
    head = (f"BK={c['bk']} S={c['s']} bs={c['block_s']} splits={c['splits']} ring={c['ring']}"
            + (f" lengths={c['lengths']}" if c.get("lengths") else "") + (" +outliers" if c.get("outliers") else "")
            + (f" ({c['outliers']} value form)" if isinstance(c.get("outliers"), str) else ""))
    if "error" in c:
      md.append(f"- FAIL {head}: {c['error']}")
    else:
      md.append(f"- {'ok' if c['ok'] else 'MISMATCH'} {head}: vs model {c['max_abs_err_vs_model']:.2e}, vs exact "
                f"softmax {c['max_abs_err_vs_exact_softmax']:.2e} (model vs exact {c['model_vs_exact']:.2e})")
  md += ["", "## Timing", "", "| impl | S | µs | MB read | TB/s | cycles/token-head | of the budget |",
         "|---|---|---|---|---|---|---|"]
  for r in rows + peer_rows:
    if "error" in r:
      md.append(f"| {r.get('config', r.get('impl'))} | {r['s']} | error: {r['error'][:120]} | | | | |")
      continue
    cyc = r["us"] * meta["mhz"] * meta["sms"] / (BK * r["s"])
    md.append(f"| {r.get('config', r.get('impl'))} | {r['s']} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | "
              f"{r['tb_per_s']:.2f} | {cyc:.2f} | {cyc / kb.TARGET_CYCLES:.0%} |")
  with open(os.path.join(out_dir, "oskvp_decode_core_mgpu.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/oskvp_decode_core_mgpu")
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode at a tiny shape; checks + report only")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--no_peers", action="store_true", help="skip the cuDNN / XLA peers (timed in runs 1-10)")
  ap.add_argument("--timed", default="", help="rows to time instead of TIMED: S:block_s:splits:ring:variant, "
                  "comma-separated (e.g. 65536:128:16:2:outliers+fp8_stacked+no_compute)")
  ap.add_argument("--checks", default="all", choices=("all", "stacked", "block256", "none"),
                  help="stacked: only the fp8_stacked checks; block256: only the block_s=256 checks; none: no "
                       "checks (a timing-only process, e.g. for MOSAIC_GPU_DUMP_TO)")
  ap.add_argument("--no_glue", action="store_true", help="skip the glue check and the whole op's timing")
  args = ap.parse_args(argv)
  timed = TIMED
  if args.timed:
    timed = [(int(a), int(b), int(c), int(d), v) for a, b, c, d, v in (t.split(":") for t in args.timed.split(","))]
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  meta = kb.run_meta(args.smoke, args.iters)
  checks, rows, peer_rows = [], [], []
  cases = SMOKE_CHECKS if args.smoke else CHECKS
  if args.checks == "stacked":
    cases = [c for c in cases if c[-1] == "fp8_stacked"]
  elif args.checks == "block256":
    cases = [c for c in cases if c[2] == 256]
  elif args.checks == "none":
    cases = []
  for case in cases:
    checks.append(run_check(case, interpret=args.smoke))
    print("check", json.dumps(checks[-1]), flush=True)
    write_report(args.out, meta, checks, rows, peer_rows)
  if not all(c["ok"] for c in checks):
    print("CHECK FAILED", flush=True)
    return 1
  for s, block_s, splits, ring, variant in [(256, 64, 2, 2, "outliers")] if args.smoke and not args.timed else timed:
    name = f"core S={s} bs={block_s} splits={splits} ring={ring}" + (f" {variant}" if variant else "")
    try:
      ablate = variant.split("+")[-1] if variant.split("+")[-1] in dc.ABLATIONS else ""
      form = next((f for f in ("f16", "fp8_stacked") if f"+{f}" in variant), "fp8")
      ms, kernels, _ = kb.kernel_ms(core_fn(block_s, splits, ring, args.smoke, ablate, form), core_args(s, variant),
                                    args.iters, args.smoke)
      nbytes = timed_bytes(s, variant)
      rows.append(dict(config=name, s=s, us=ms * 1e3, bytes=nbytes, tb_per_s=nbytes / ms / 1e9, kernels=kernels))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(config=name, s=s, error=f"{type(e).__name__}: {str(e)[:600]}"))
    print("time", json.dumps(rows[-1]), flush=True)
    write_report(args.out, meta, checks, rows, peer_rows)
  if not args.no_glue:
    glue = glue_check(args.smoke)
    checks.append(glue)
    print("glue check", json.dumps(glue), flush=True)
  if not args.smoke and not args.no_glue:  # the whole op at 64k x 8: query digits, the core, the merge of splits, c0 + d · out
    try:
      ms, kernels, _ = kb.kernel_ms(glue_fn("pallas", False), glue_inputs(0, BK, 65536), args.iters, False)
      nbytes = timed_bytes(65536, "outliers")
      rows.append(dict(config="attend_codes (ragged, outliers; XLA prologue/epilogue + core)", s=65536, us=ms * 1e3,
                       bytes=nbytes, tb_per_s=nbytes / ms / 1e9, kernels=kernels))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(config="attend_codes", s=65536, error=f"{type(e).__name__}: {str(e)[:600]}"))
    print("time", json.dumps(rows[-1]), flush=True)
  write_report(args.out, meta, checks, rows, peer_rows)
  for s in () if args.no_peers else (65536, 16384):
    peer_rows += peers(s, args.iters, args.smoke)
    write_report(args.out, meta, checks, rows, peer_rows)
  with open(os.path.join(args.out, "oskvp_decode_core_mgpu.md")) as fh:
    print(fh.read())
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  return 0 if all(c["ok"] for c in checks) else 1  # the glue check comes after the timings: fail the run on it too


if __name__ == "__main__":
  sys.exit(main())
