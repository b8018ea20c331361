"""Where an OS-KVP decode-attention call spends its time: every GPU kernel of one call, by CUPTI, next to the
wall-clock time per call of back-to-back calls (the figure `decode_attention.py` reports), for the kernel variants
that differ in what runs around the attention kernel (XLA query preparation and merge, or the Pallas prologue and
the values applied in-kernel), with cuDNN on a bf16 cache timed the same way in the same run.

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/decode_attention_breakdown.py --out=$OUT
Writes decode_attention_breakdown.{md,json}: per (implementation, batch, context) the kernels of one call (name,
median ms over `--iters` calls, L2 flushed before each), their sum, the Pallas kernel's share, and the wall ms per
call. The difference between the wall time and the kernel sum is launch gaps between the call's kernels.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import statistics
import sys
import warnings

import jax
import jax.numpy as jnp

from benchmarks.chained_timing import timeit
from benchmarks.decode_attention import (HEAD_DIM, KV_HEADS, N_HEADS, WINDOW, bf16_cache, check_correctness,
                                         cudnn_bf16, kernel_fn, oskvp_args, oskvp_bytes)
from pallas_kernels.oskvp_decode_attention import BITPLANE

# What runs around the attention kernel: XLA query preparation + XLA merge (the first default), the Pallas prologue,
# and the Pallas prologue with the value codebooks applied in the kernel (XLA merge of [4, G, Q] partials).
VARIANTS = {
    "xla_io": dataclasses.replace(BITPLANE, pallas_prologue=False, values_in_kernel=False),
    "prologue": dataclasses.replace(BITPLANE, pallas_prologue=True, values_in_kernel=False),
    "prologue_values": dataclasses.replace(BITPLANE, pallas_prologue=True, values_in_kernel=True),
}

warnings.filterwarnings("ignore", category=DeprecationWarning)


def kernel_times(fn, args, iters: int):
  """[(kernel name, median ms)] of one call of jitted `fn(*args)`, in launch order, L2 flushed before each call."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  flush_buf = jnp.zeros((64 << 20,), jnp.float32)
  flush = jax.jit(lambda b: b + 1.0)
  per_kernel = collections.defaultdict(list)
  names = None
  for _ in range(iters):
    flush_buf = jax.block_until_ready(flush(flush_buf))
    _, timings = profiler.measure(fn, aggregate=False)(*args)
    names = [n for n, _ in timings]
    for i, (_, ms) in enumerate(timings):
      per_kernel[i].append(ms)
  return [(names[i], statistics.median(per_kernel[i])) for i in range(len(names))]


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/decode_attention_breakdown")
  ap.add_argument("--cases", default="1x4096,1x16384,1x65536,8x4096,8x65536",
                  help="batch x context, comma separated")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--check", action="store_true", help="first check every variant against the reference (GPU)")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  variants = args.variants.split(",")
  checks = []
  if args.check:
    checks = check_correctness(print, ("bitplane",), only=[VARIANTS[v] for v in reversed(variants)])
  rows = []
  for case in args.cases.split(","):
    b, s = (int(v) for v in case.split("x"))

    def kv_bshk(i, b=b, s=s):
      k, v = bf16_cache(jax.random.key(i), b, s)
      q = jax.random.normal(jax.random.key(i), (b, N_HEADS, HEAD_DIM), jnp.bfloat16)
      return (q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))

    fn, a = jax.jit(cudnn_bf16), kv_bshk(0)
    kernels = kernel_times(fn, a, args.iters)
    wall = timeit(fn, kv_bshk, 2 * b * KV_HEADS * s * HEAD_DIM * 2)
    rows.append({"impl": "cudnn_bf16", "batch": b, "context": s, "wall_ms": wall,
                 "kernel_sum_ms": sum(ms for _, ms in kernels), "pallas_ms": 0.0, "n_kernels": len(kernels),
                 "kernels": kernels})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
    del a
    for impl, sym, var in [(f"oskvp_{v}" + ("_sym" if sym else ""), sym, v) for v in variants for sym in (0, 1)]:
      fn = jax.jit(kernel_fn(VARIANTS[var], symmetric=bool(sym)))
      a = oskvp_args(jax.random.key(0), b, s, symmetric=sym)
      kernels = kernel_times(fn, a, args.iters)
      wall = timeit(fn, lambda i: oskvp_args(jax.random.key(i), b, s, symmetric=sym), oskvp_bytes(b, s))
      total = sum(ms for _, ms in kernels)
      pallas = sum(ms for n, ms in kernels if "oskvp_decode_bitplane" in n)
      row = {"impl": impl, "batch": b, "context": s, "wall_ms": wall, "kernel_sum_ms": total, "pallas_ms": pallas,
             "n_kernels": len(kernels), "kernels": kernels}
      rows.append(row)
      print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
      for n, ms in kernels:
        print(f"    {ms * 1e3:8.1f} us  {n}", flush=True)
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "window": WINDOW, "checks": checks,
          "variants": {k: str(VARIANTS[k]) for k in variants},
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  with open(os.path.join(args.out, "decode_attention_breakdown.json"), "w") as fh:
    json.dump({**meta, "rows": rows}, fh, indent=1)
  md = [f"# OS-KVP decode call, kernel by kernel: {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
        "CUPTI kernel times (median of the calls, L2 flushed) and wall ms per call of back-to-back calls.", "",
        "Variants: " + "; ".join(f"`{k}`" for k in variants) + " (see VARIANTS in the script).", "",
        "| impl | batch | context | wall ms | vs cuDNN (wall) | kernels | kernel sum ms | attention kernel ms | "
        "other kernels ms | wall - kernel sum |",
        "|---|---|---|---|---|---|---|---|---|---|"]
  cudnn = {(r["batch"], r["context"]): r["wall_ms"] for r in rows if r["impl"] == "cudnn_bf16"}
  for r in rows:
    md.append(f"| {r['impl']} | {r['batch']} | {r['context']} | {r['wall_ms']:.4f} | "
              f"{cudnn[(r['batch'], r['context'])] / r['wall_ms']:.2f}x | {r['n_kernels']} | "
              f"{r['kernel_sum_ms']:.4f} | {r['pallas_ms']:.4f} | {r['kernel_sum_ms'] - r['pallas_ms']:.4f} | "
              f"{r['wall_ms'] - r['kernel_sum_ms']:.4f} |")
  if checks:
    md += ["", "GPU correctness (relative L2 error vs the jnp reference, poisoned partials):", ""]
    md += [f"- case {c['case']}{' symmetric' if c['symmetric'] else ''}: "
           + (f"rel_err {c['rel_err']:.2e}, nan={c['nan']}" if "rel_err" in c else c["error"]) + f" — {c['config']}"
           for c in checks]
  md += ["", "Kernels of each call (us):", ""]
  for r in rows:
    md.append(f"- {r['impl']} {r['batch']}x{r['context']}: " +
              ", ".join(f"{n} {ms * 1e3:.1f}" for n, ms in r["kernels"]))
  with open(os.path.join(args.out, "decode_attention_breakdown.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
