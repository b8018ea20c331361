"""Where the wall-clock time of a decode-attention call goes: the GPU timeline of `decode_attention.timeit`'s program.

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/decode_timeline.py --out=$OUT
`decode_attention.py` times a call as the wall clock of a jitted program of 8+ chained calls, divided by the calls;
`oskvp_uniform_profile.py` times each kernel alone (CUPTI). The two differ by tens of µs for the wired OS-KVP path
(0.227 ms wall vs 182 µs of kernels at 64k × 8). This script traces that same chained program with the JAX profiler
and reads the timeline: per call, the GPU span, the time kernels run, the idle gaps and which kernel each gap
precedes, and the host-side events that overlap the program (is the host launching slower than the GPU runs?).
Writes decode_timeline.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import glob
import json
import os
import sys
import tempfile

import jax
from jax.profiler import ProfileData

from benchmarks import chained_timing
from benchmarks import decode_attention as da
from benchmarks import decode_attention_mosaic as mos


def _impls(b: int, s: int) -> dict:
  """name -> (fn, make_args, bytes per call)."""
  q_of = lambda i: jax.random.normal(jax.random.key(i), (b, da.N_HEADS, da.HEAD_DIM), jax.numpy.bfloat16)

  def kv_bshk(i):
    k, v = da.bf16_cache(jax.random.key(i), b, s)
    return (q_of(i), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))

  uniform = lambda i: mos.uniform_args(jax.random.key(i), b, s)
  return {
      "oskvp_mosaic_uniform": (mos.mosaic_uniform, uniform, da.oskvp_bytes(b, s)),
      "oskvp_mosaic_uniform_xla_glue": (functools.partial(mos.mosaic_uniform, glue="xla"), uniform,
                                        da.oskvp_bytes(b, s)),
      # the warp-level core, the wired path's default on a GPU since the forty-first session (the rows above: wgmma)
      "oskvp_mosaic_uniform_mma": (functools.partial(mos.mosaic_uniform, core="mma"), uniform, da.oskvp_bytes(b, s)),
      # and with U_vᵀ inside its epilogue (forty-sixth session)
      "oskvp_mosaic_uniform_mma_orot_epilogue": (
          functools.partial(mos.mosaic_uniform, core="mma", output_rotation="epilogue"), uniform, da.oskvp_bytes(b, s)),
      "cudnn_bf16": (da.cudnn_bf16, kv_bshk, 2 * b * da.KV_HEADS * s * da.HEAD_DIM * 2),
  }


def _events(space: ProfileData, gpu: bool):
  """[(line name, event name, start ns, duration ns)] of the GPU planes' stream lines, or of the host planes."""
  out = []
  for plane in space.planes:
    if plane.name.startswith("/device:GPU") != gpu or (not gpu and not plane.name.startswith("/host")):
      continue
    lines = list(plane.lines)
    if gpu:  # the kernels are on the stream lines; the others are derived views (XLA Ops, Modules, ...)
      lines = [ln for ln in lines if ln.name.startswith("Stream")] or lines
    for ln in lines:
      out += [(ln.name, ev.name, ev.start_ns, ev.duration_ns) for ev in ln.events]
  return out


def timeline(fn, make_args, nbytes: int, min_calls: int) -> dict:
  """`trace_chained` of `chained_calls`' program for fn."""
  return trace_chained(chained_timing.chained_calls(fn, make_args, nbytes, min_calls))


def trace_chained(chained) -> dict:
  """Traces one run (after two warm-up runs) of a `chained_calls` program; returns the per-call GPU span, busy
  time, gaps by the kernel that follows them, and the host events overlapping the run."""
  multi, qs, arg_sets, calls = chained
  jax.block_until_ready(multi(qs, arg_sets))
  jax.block_until_ready(multi(qs, arg_sets))
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    jax.block_until_ready(multi(qs, arg_sets))
    jax.profiler.stop_trace()
    path = sorted(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True))[-1]
    space = ProfileData.from_file(path)
    kernels, host = _events(space, gpu=True), _events(space, gpu=False)
  return summarize(kernels, host, calls)


def summarize(kernels: list[tuple], host: list[tuple], calls: int) -> dict:
  """kernels, host: [(line, name, start ns, duration ns)] of one run of `calls` calls -> per call: the GPU span (first
  kernel start to last kernel end), the time at least one kernel runs, the idle rest, the idle time by the kernel it
  precedes, each kernel's own running time (their sum exceeds the busy time where kernels overlap), and the host
  events overlapping the span, by name."""
  if not kernels:
    return dict(calls=calls, error="no GPU events in the trace")
  kernels = sorted(kernels, key=lambda e: e[2])
  t0, t1 = kernels[0][2], max(e[2] + e[3] for e in kernels)
  busy, gaps, end = 0.0, collections.defaultdict(list), t0
  own = collections.defaultdict(list)
  for _, name, start, dur in kernels:
    gaps[name].append(max(0.0, start - end))
    own[name].append(dur)
    busy += max(0.0, start + dur - max(start, end))  # the part not overlapping what already ran
    end = max(end, start + dur)
  by_host = collections.defaultdict(lambda: [0, 0.0])
  for _, name, start, dur in host:
    if start + dur >= t0 and start <= t1:
      by_host[name][0] += 1
      by_host[name][1] += dur
  us = 1e-3 / calls
  return dict(
      calls=calls, kernels_per_call=len(kernels) / calls, span_us=(t1 - t0) * us, busy_us=busy * us,
      gap_us=(t1 - t0 - busy) * us,
      gaps_before=sorted(({"kernel": k, "count": len(v) / calls, "us": sum(v) * us} for k, v in gaps.items()),
                         key=lambda r: -r["us"]),
      kernel_us=sorted(({"kernel": k, "count": len(v) / calls, "us": sum(v) * us} for k, v in own.items()),
                       key=lambda r: -r["us"]),
      host_top=sorted(({"event": k, "count": c / calls, "us": d * us} for k, (c, d) in by_host.items()),
                      key=lambda r: -r["us"])[:25],
      lines=sorted({e[0] for e in kernels}))


def _table(what: str, time: str, entries: list[dict], digits: int = 2) -> list[str]:
  """Markdown lines of `summarize`'s per-name entries ({kernel or event, count, us})."""
  name = lambda e: e.get("kernel", e.get("event"))[:90]
  return [f"| {what} | per call | {time} |", "|---|---|---|",
          *(f"| {name(e)} | {e['count']:.1f} | {e['us']:.{digits}f} |" for e in entries)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/decode_timeline")
  ap.add_argument("--cases", default="8x65536,1x65536", help="batch x context, comma-separated")
  ap.add_argument("--impls", default="oskvp_mosaic_uniform,cudnn_bf16")
  ap.add_argument("--min_calls", type=int, default=8)
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  md = [f"# Decode-attention timelines: {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
        "The program `decode_attention.timeit` times (chained calls), traced with the JAX profiler; µs per call.", ""]
  rows = []
  for case in args.cases.split(","):
    b, s = (int(x) for x in case.split("x"))
    impls = _impls(b, s)
    for name in args.impls.split(","):
      fn, make_args, nbytes = impls[name]
      r = dict(impl=name, batch=b, context=s, **timeline(fn, make_args, nbytes, args.min_calls))
      rows.append(r)
      print(json.dumps(r)[:2000], flush=True)
      if "error" in r:
        md += [f"## {name}, batch {b} × context {s}: {r['error']}", ""]
        continue
      md += [f"## {name}, batch {b} × context {s}: span {r['span_us']:.1f} µs per call, kernels running "
             f"{r['busy_us']:.1f}, idle {r['gap_us']:.1f} ({r['kernels_per_call']:.0f} kernels per call)", "",
             *_table("kernel", "running µs per call", r["kernel_us"][:16]), "",
             *_table("idle before kernel", "µs per call", r["gaps_before"][:12]), "",
             *_table("host event overlapping the run", "µs per call", r["host_top"][:15], digits=1), ""]
  with open(os.path.join(args.out, "decode_timeline.json"), "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
  with open(os.path.join(args.out, "decode_timeline.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
