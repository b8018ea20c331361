"""The tail of the wired OS-KVP decode attention on its own: `epilogue` + the XLA U_vᵀ matmul (and its fused cast)
against `rotating_epilogue` (both in one Pallas kernel), by CUPTI kernel time on a GPU.

Run on the GPU:  PYTHONPATH=$PWD python3 benchmarks/oskvp_epilogue_bench.py --out=$OUT
CPU smoke test:  PYTHONPATH=$PWD python3 benchmarks/oskvp_epilogue_bench.py --smoke --out=/tmp/epi_smoke

Shapes: the benchmark's attention (32 query heads over 8 kv heads, head dim 128, a 128-token window, bf16 queries) at
the batches and splits the wired path runs at 64k (`wired_tiling`, mma core: batch 8 takes 8 splits, batch 32 takes 2,
batch 1 32) and at 16, the wgmma core's and the mma core's before the forty-seventh session (the forty-sixth session's
H100 runs, results/oskvp_epilogue_h100_s46{,b}.md, timed batch 32 at 4, 8 and 16 splits and batch 1 at 64). Forms:
`epilogue` then the XLA matmul (as glue="pallas" runs it by default: its programs' width by `epilogue_channels`),
`rotating_epilogue` at 4 and 8 warps with all 128 output channels per program, and at 4 warps with 64 or 32 (the
merge repeated 2 or 4 times, twice or four times the programs), and `epilogue` with 32, 64 or 128 output channels per
program (`channels`: the window scored once for 1, 2 or 4 runs of 32) then the XLA matmul. --forms times a subset.
Per case, each form is first checked against `rotating_epilogue_reference` (relative L2 in the query's dtype;
any failure stops the run before timing), then timed: the median over --iters calls of the summed CUPTI time of the
kernels one call launches (on the CPU, --smoke: wall clock in interpret mode, at tiny shapes, to exercise the report;
the numbers mean nothing). Writes oskvp_epilogue_<device>.{md,json} under --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report_files
from benchmarks.cupti import cupti_median_ms
from pallas_kernels import oskvp_uniform_epilogue as epi
from pallas_kernels.oskvp_random import random_epilogue_inputs

KV_HEADS, G, H, R = 8, 4, 128, 128
CASES = ((8, 8), (8, 16), (32, 2), (32, 16), (1, 32))  # (batch, splits)
SMOKE_CASES = ((2, 4),)


def tail_inputs(key, b: int, kh: int, splits: int, h: int):
  """`random_epilogue_inputs` for b rows × kh kv heads with ragged windows (77 tokens on odd rows, R on even) ->
  (`epilogue`'s arguments, U_v)."""
  *args, u_v = random_epilogue_inputs(key, jnp.where(jnp.arange(b) % 2 == 1, 77, R), batch=b, kv_heads=kh,
                                      splits=splits, group=G, head_dim=h, window=R)
  return tuple(args), u_v


def forms(interpret: bool) -> dict:
  """name -> fn(args, u_v) -> bf16 [B, K, G, H]."""
  def xla_rotation(args, u_v, channels=None):
    o = epi.epilogue(*args, interpret=interpret, channels=channels)
    return jnp.einsum("BKGJ,BKHJ->BKGH", o, u_v).astype(jnp.bfloat16)

  wide = lambda hc: functools.partial(xla_rotation, channels=hc)

  rotating = lambda warps, cols=None: lambda args, u_v: epi.rotating_epilogue(
      *args, u_v, out_dtype=jnp.bfloat16, interpret=interpret, num_warps=warps, out_channels=cols)
  return {"epilogue+xla_rotation": xla_rotation, "rotating_epilogue_w4": rotating(4),
          "rotating_epilogue_w8": rotating(8), "rotating_epilogue_w4_c64": rotating(4, 64),
          "rotating_epilogue_w4_c32": rotating(4, 32), "epilogue_c32+xla_rotation": wide(32),
          "epilogue_c64+xla_rotation": wide(64),
          "epilogue_c128+xla_rotation": wide(128)}


def kernel_ms(fn, iters: int, gpu: bool) -> tuple[float, int]:
  """Median ms of one call over iters (CUPTI kernel sum on a GPU, else wall clock) and the kernels per call."""
  if gpu:
    return cupti_median_ms(fn, iters)
  jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/oskvp_epilogue")
  ap.add_argument("--iters", type=int, default=30)
  ap.add_argument("--smoke", action="store_true", help="interpret mode on the CPU, tiny shapes")
  ap.add_argument("--forms", default="", help="comma-separated forms to time (default: all; the first is the base)")
  args = ap.parse_args(argv)
  gpu = jax.devices()[0].platform == "gpu" and not args.smoke
  cases, kh, iters = (CASES, KV_HEADS, args.iters) if not args.smoke else (SMOKE_CASES, 2, 2)
  fns = forms(interpret=not gpu)
  if args.forms:
    unknown = set(args.forms.split(",")) - set(fns)
    if unknown:
      ap.error(f"--forms: unknown {sorted(unknown)} (forms: {', '.join(fns)})")
    fns = {name: fns[name] for name in args.forms.split(",")}
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              timing="CUPTI kernel sum, median" if gpu else "wall clock (interpret mode: meaningless)")
  rows, md = [], [f"# The OS-KVP epilogue forms: {jax.devices()[0].device_kind}, jax {jax.__version__}, {meta['date']}",
                  "", f"Timing: {meta['timing']} over {iters} calls. K = {kh} kv heads, G = {G}, H = {H}, window {R}.",
                  "", "| batch | splits | form | rel. err (bf16) | kernels | µs | × the first form |",
                  "|---|---|---|---|---|---|---|"]
  for b, splits in cases:
    tail, u_v = tail_inputs(jax.random.key(b * 100 + splits), b, kh, splits, H)
    want = np.asarray(epi.rotating_epilogue_reference(*tail, u_v), np.float32)
    base = None
    for name, fn in fns.items():
      got = np.asarray(jax.jit(fn)(tail, u_v), np.float32)
      err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
      if not err < 1e-2 or not np.isfinite(got).all():  # a bf16 output: ~2^-9 relative
        print(f"{name} B={b} splits={splits}: rel err {err:.3g}; stopping before the timings", flush=True)
        return 1
      ms, kernels = kernel_ms(functools.partial(jax.jit(fn), tail, u_v), iters, gpu)
      base = base or ms
      rows.append(dict(batch=b, splits=splits, form=name, rel_err=err, kernels=kernels, us=ms * 1e3))
      md.append(f"| {b} | {splits} | {name} | {err:.1e} | {kernels} | {ms * 1e3:.2f} | {base / ms:.2f}× |")
      print(md[-1], flush=True)
  report_files.write(args.out, "oskvp_epilogue", dict(meta=meta, rows=rows), md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
