"""block_r="auto" on the H200: the WS int4 kernel with its row tile picked on the device from group_sizes.

  PYTHONPATH=$PWD python3 benchmarks/int4_ws_auto_block_r.py --out=$OUT

`int4_grouped_matmul_mgpu_ws(block_r="auto")` compiles one kernel per candidate R and runs the one that
`auto_block_r_index` picks (`lax.switch`). This times it against the static default (`default_block_r`) and R = 32
under random and balanced routing, each as a jitted chain of CHAIN dependent calls (each call's output feeds the
next call's lhs through a zero-weighted scalar): CUPTI's sum of the chain's kernels (L2 flushed before each chain,
median of --iters) and the chain's wall clock (median), both per call. A conditional whose predicate XLA brings to
the host shows as wall clock above the kernels; the markdown also counts the compiled program's conditionals and
command buffers (in a CUDA graph's conditional node the predicate stays on the device). Writes int4_ws_auto_block_r.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import expert_matmul as em
from pallas_kernels import int4_grouped_matmul_mgpu_ws as ws

CELLS = [(64, 4096, 2048, 1024), (128, 2048, 768, 2048)]  # (E, K, N, rows): 16 rows per expert on average
CONFIGS = {"default": {}, "r32": dict(block_r=32), "auto": dict(block_r="auto")}
CHAIN = 8


def chain(kernel, n_calls: int):
  """A jitted function running `kernel` n_calls times, each call's lhs depending on the previous call's output."""

  def run(x, w, gs):
    for _ in range(n_calls):
      out = kernel(x, w, gs)
      x = x + (out[0, 0] * 0).astype(x.dtype)
    return x

  return jax.jit(run)


def wall_ms(f, args, iters: int) -> float:
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append((time.perf_counter() - t) * 1e3)
  return statistics.median(ts)


def markdown(result: dict) -> str:
  out = [f"Device {result['device']}, jax {result['jax']}, {result['date']}; per call of a chain of {CHAIN}: CUPTI "
         "kernel sum (L2 flushed before each chain) and wall clock, medians.", "",
         "| E, K->N | rows | routing | config | picked R | kernels ms | wall ms | x default (kernels) | "
         "HLO: conditionals, command buffers |", "|---|---|---|---|---|---|---|---|---|"]
  base = {(r["e"], r["rows"], r["routing"]): r["kernel_ms"] for r in result["rows"] if r["config"] == "default"}
  for r in result["rows"]:
    b = base.get((r["e"], r["rows"], r["routing"]))
    out.append(f"| {r['e']}, {r['k']}->{r['n']} | {r['rows']} | {r['routing']} | {r['config']} | {r['picked']} | "
               f"{r['kernel_ms']:.4f} | {r['wall_ms']:.4f} | {b / r['kernel_ms']:.2f} | {r['command_buffer']} |")
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, one tiny cell: checks the script only")
  args = ap.parse_args(argv)
  cells, extra = (([(4, 256, 128, 24)], dict(interpret=True, num_ctas=4)) if args.smoke else (CELLS, {}))
  timer, timing = em._timer()  # pylint: disable=protected-access
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "timing": timing,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  rows = []
  for e, k, n, m in cells:
    key = jax.random.key(e + k + n)
    w = ws.to_mgpu_layout(em.random_int4(key, e, k, n))
    x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
    for name, cfg in CONFIGS.items():
      f = chain(functools.partial(ws.int4_grouped_matmul_mgpu_ws, **cfg, **extra), CHAIN)
      hlo = f.lower(x, w, jnp.zeros((e,), jnp.int32)).compile().as_text()
      cmd = (f"{hlo.count('conditional(')} conditional, {hlo.count('command_buffer')} command_buffer"
             if cfg.get("block_r") == "auto" else "-")
      for routing in em.ROUTINGS:
        gs_np = em.routed_groups(m, e, routing)
        gs = jnp.asarray(gs_np)
        picked = cfg.get("block_r") or ws.default_block_r(m, e, True)
        if picked == "auto":
          cands = ws.AUTO_BLOCK_RS
          wgs = tuple(ws.default_compute_wgs(m, e, n, r, extra.get("num_ctas") or ws._num_sms()) for r in cands)  # pylint: disable=protected-access
          picked = cands[int(ws.auto_block_r_index(gs_np, m, n, cands, wgs, extra.get("num_ctas") or ws._num_sms(), True))]  # pylint: disable=protected-access
        try:
          kernel_ms = timer(f, x, w, gs, iters=args.iters) / CHAIN
          wall = wall_ms(f, (x, w, gs), args.iters) / CHAIN
        except Exception as ex:  # noqa: BLE001
          print("fail", e, n, m, name, routing, type(ex).__name__, str(ex)[:300], flush=True)
          continue
        rows.append(dict(e=e, k=k, n=n, rows=m, routing=routing, config=name, picked=picked, kernel_ms=kernel_ms,
                         wall_ms=wall, command_buffer=cmd))
        print(json.dumps(rows[-1]), flush=True)
  result = {**meta, "chain": CHAIN, "rows": rows}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "int4_ws_auto_block_r.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  md = markdown(result)
  with open(os.path.join(args.out, "int4_ws_auto_block_r.md"), "w") as fh:
    fh.write(md)
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
