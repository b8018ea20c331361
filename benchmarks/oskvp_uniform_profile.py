"""Per-kernel time of the wired Mosaic GPU path of `kv_cache="oskvp_uniform"` (`uniform_decode_attention`).

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/oskvp_uniform_profile.py --out=$OUT
Times one decode-attention call at context × batch (default 64k × 8; 32 query / 8 kv heads, H = 128, window 128)
with CUPTI (`jax.experimental.mosaic.gpu.profiler`, L2 flushed before each call), median over calls of each kernel,
and writes oskvp_uniform_profile.{md,json}: where the time goes between the core and the XLA glue around it. The
core is `benchmarks.decode_attention_mosaic.mosaic_uniform`'s default, the wgmma core (the wired path's default until
the forty-first session; the warp-level core is `decode_attention.py --mosaic_core=mma`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import jax

from benchmarks.decode_attention_mosaic import mosaic_uniform, uniform_args
from benchmarks.decode_attention_breakdown import kernel_times


def profile(b: int, s: int, iters: int, glue: str = "auto") -> list[dict]:
  """[{name, ms (median over calls)}] of one jitted call, in launch order (`decode_attention_breakdown.kernel_times`)."""
  fn = jax.jit(functools.partial(mosaic_uniform, glue=glue))
  args = uniform_args(jax.random.key(0), b, s)
  jax.block_until_ready(fn(*args))
  return [dict(name=name, ms=ms) for name, ms in kernel_times(fn, args, iters)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/oskvp_uniform_profile")
  ap.add_argument("--cases", default="8x65536,1x65536,32x65536,8x16384", help="batch x context, comma-separated")
  ap.add_argument("--iters", type=int, default=7)
  ap.add_argument("--glue", default="auto", choices=("auto", "xla", "pallas"), help="uniform_decode_attention's glue=")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, glue=args.glue,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  result = dict(meta=meta, cases=[])
  md = [f"# Wired Mosaic GPU path of oskvp_uniform (glue={args.glue}), per kernel: {meta['device']}, jax {meta['jax']}, "
        f"{meta['date']}",
        "", "CUPTI kernel time, median of the calls, L2 flushed before each call; 32 query / 8 kv heads, H = 128.", ""]
  for case in args.cases.split(","):
    b, s = (int(x) for x in case.split("x"))
    rows = profile(b, s, args.iters, args.glue)
    total = sum(r["ms"] for r in rows)
    core = sum(r["ms"] for r in rows if "mosaic" in r["name"])
    result["cases"].append(dict(batch=b, context=s, kernels=rows, total_ms=total, core_ms=core))
    md += [f"## batch {b} × context {s}: {total * 1e3:.1f} µs in {len(rows)} kernels, the core {core * 1e3:.1f} µs",
           "", "| kernel | µs |", "|---|---|"] + [f"| {r['name']} | {r['ms'] * 1e3:.1f} |" for r in rows] + [""]
    print(md[-len(rows) - 4], flush=True)
  with open(os.path.join(args.out, "oskvp_uniform_profile.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  with open(os.path.join(args.out, "oskvp_uniform_profile.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
