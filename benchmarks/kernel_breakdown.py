"""Per-kernel CUPTI times of one call, for the Mosaic GPU kernels next to their memory-side ceilings (H200).

  PYTHONPATH=$PWD python3 benchmarks/kernel_breakdown.py --out=$OUT            # all cases
  PYTHONPATH=$PWD python3 benchmarks/kernel_breakdown.py --cases=read,int4 --out=$OUT

`decode_attention.py`, `expert_matmul.py` and the kernel benchmarks time a call as the sum of all its kernels (the
XLA kernels around a Pallas call included, each after an L2 flush). This script splits that sum: the median time of
every kernel of the call (L2 flushed before each call), so that a kernel's own time, its `ablate="no_compute"`
ceiling (the TMA ring streaming every tile with the compute skipped) and XLA's read of the same number of bytes
(`jnp.sum` over a uint8 buffer of that size: what the memory system gives a plain read of this size) sit side by
side. Cases:
- read: XLA read-only sums of 268 MB (int4 weights of 64 × 4096→2048; the core's codes at 64k × 8), 335 MB (the
  core's codes and outliers) and 1 GiB (the copy bandwidth of the other scripts).
- int4: 64 experts × 4096→2048 × 512 rows and 128 × 2048→768 × 2048 rows, balanced: jax's Mosaic bf16
  `ragged_dot_mgpu` (the best bf16 peer there) and the WS int4 kernel with its defaults, its work table each way
  (`table_impl`: the Pallas kernel, its masked-sum first form, XLA). (The first form of this case,
  results/kernel_breakdown.md, timed C = 2 / C = 4 and their no_compute forms at the first shape.)
- table: the WS kernel's work table alone at the issue's shapes (E = 8, 64, 128; the kernel's default tiles, block_r
  and C): its jnp reference under XLA, and the Pallas kernel with masked-sum and scan prefix sums and 16-64 rows per
  program (MB column: not meaningful, 1 byte). results/kernel_breakdown_scan.md timed padded tiles, the default then.
- core: the OS-KVP core at 64k × 8 (BK = 64, block 128, 16 splits, fp8_stacked outliers, ring 2), with no_compute at
  rings 2 and 3, the codes-only no_compute, and l2_resident at rings 2 and 3 (the full compute on blocks that L2
  serves: the compute side's own time).
- core_blocks (not in the default run): the core and its l2_resident form at blocks 64 / 128 and 16 / 32 splits.
Writes kernel_breakdown.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks import expert_matmul as em
from benchmarks import oskvp_decode_core_mgpu_bench as cb
from benchmarks import oskvp_key_scores_mgpu_bench as kb
from pallas_kernels import int4_grouped_matmul_mgpu as mg
from pallas_kernels import int4_grouped_matmul_mgpu_ws as ws
from pallas_kernels import ws_pipeline as wp

CASES = ("read", "int4", "table", "core")


def per_kernel_ms(fn, args, iters: int) -> dict[str, float]:
  """Median over `iters` calls (L2 flushed before each) of each kernel's CUPTI time, ms, by name (repeated names
  get a #i suffix); the key "total" holds the median of the per-call sums."""
  jax.block_until_ready(fn(*args))  # compile
  per, totals = {}, []
  for timings in kb.call_timings(fn, args, iters):
    seen = {}
    for name, ms in timings:
      seen[name] = seen.get(name, -1) + 1
      per.setdefault(name if not seen[name] else f"{name}#{seen[name]}", []).append(ms)
    totals.append(sum(ms for _, ms in timings))
  return {**{k: statistics.median(v) for k, v in per.items()}, "total": statistics.median(totals)}


def _read_cases():
  for mb in (268.4, 335.5, 1073.7):
    x = jnp.ones((int(mb * 1e6),), jnp.uint8)
    yield f"xla_sum_read {mb:.0f} MB", jax.jit(lambda a: jnp.sum(a, dtype=jnp.int32)), (x,), x.nbytes


def _int4_cases():
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd  # pylint: disable=g-import-not-at-top
  for e, k, n, rows in ((64, 4096, 2048, 512), (128, 2048, 768, 2048)):
    key = jax.random.key(0)
    gs = jnp.asarray(em.balanced_groups(rows, e))
    x = jax.random.normal(key, (rows, k), jnp.bfloat16)
    w_bf16 = jax.random.normal(key, (e, k, n), jnp.bfloat16)
    f = jax.jit(functools.partial(rd.ragged_dot, group_sizes=gs, **em.MGPU_BF16_PEER))
    yield f"{e} x {k}->{n} x {rows}: mgpu_ragged_dot_bf16", f, (x, w_bf16), w_bf16.nbytes
    del w_bf16
    w = mg.to_mgpu_layout(em.random_int4(key, e, k, n), nibble_order="shift")
    for table in ("pallas", "pallas_masked", "xla"):  # the WS kernel's defaults (C per shape), each work table
      f = jax.jit(functools.partial(ws.int4_grouped_matmul_mgpu_ws, table_impl=table))
      yield f"{e} x {k}->{n} x {rows}: int4_ws (table {table})", f, (x, w, gs), e * k * n // 2


def _table_cases():
  from pallas_kernels import int4_ws_work_table as wt  # pylint: disable=g-import-not-at-top
  n_ctas = wp.num_sms()
  for e, n, rows in ((8, 14336, 128), (64, 2048, 1024), (128, 768, 2048), (128, 768, 512)):
    gs = jnp.asarray(em.balanced_groups(rows, e))
    block_r = ws.default_block_r(rows, e, aligned_tiles=True)
    c = ws.default_compute_wgs(rows, e, n, block_r, n_ctas)
    kw = dict(block_r=block_r, n_tiles=-(-n // (64 * c)), n_experts=e, n_ctas=n_ctas, aligned=True)
    m_loaded = wt.loaded_rows(rows, block_r, aligned=True)
    label = f"table {e} experts, N {n} (C {c}), {rows} rows"
    f = jax.jit(functools.partial(wt.work_table_reference, m=rows, m_loaded=m_loaded, **kw))
    yield f"{label}: xla", f, (gs,), 1
    for prefix, block in (("masked", 64), ("scan", 64), ("scan", 32), ("scan", 16)):
      f = jax.jit(functools.partial(wt.work_table, m=rows, m_loaded=m_loaded, prefix=prefix, block=block, **kw))
      yield f"{label}: pallas {prefix} block {block}", f, (gs,), 1


def _core_case(label: str, block_s: int, splits: int, ring: int, variant: str):
  """One OS-KVP core case at 64k × 8: variant "[outliers+fp8_stacked][+ablation]" (the ablation no_compute or
  l2_resident, last)."""
  s = 65536
  last = variant.rsplit("+", 1)[-1]
  ablate = last if last in ("no_compute", "l2_resident") else ""
  form = "fp8_stacked" if "fp8_stacked" in variant else "fp8"
  return (label, cb.core_fn(block_s, splits, ring, False, ablate, form), cb.core_args(s, variant),
          cb.timed_bytes(s, variant))


def _core_cases():
  for ring, variant in ((2, "outliers+fp8_stacked"), (2, "outliers+fp8_stacked+no_compute"),
                        (3, "outliers+fp8_stacked+no_compute"), (2, "no_compute"),
                        (2, "outliers+fp8_stacked+l2_resident"), (3, "outliers+fp8_stacked+l2_resident")):
    yield _core_case(f"core ring={ring} {variant}", 128, 16, ring, variant)


def _core_blocks_cases():
  """The core and its compute side alone (l2_resident) at other blocks and splits: whether more, smaller programs
  per SM shorten the compute or not."""
  for block_s, splits in ((128, 16), (64, 16), (64, 32), (128, 32)):
    for variant in ("outliers+fp8_stacked", "outliers+fp8_stacked+l2_resident"):
      yield _core_case(f"core block={block_s} splits={splits} ring=2 {variant}", block_s, splits, 2, variant)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/kernel_breakdown")
  ap.add_argument("--cases", default=",".join(CASES))
  ap.add_argument("--iters", type=int, default=7)
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "timing": "CUPTI per kernel, median of --iters calls, 256 MB write before each call (L2 flush)"}
  rows = []
  gens = {"read": _read_cases, "int4": _int4_cases, "table": _table_cases, "core": _core_cases,
          "core_blocks": _core_blocks_cases}
  for case in args.cases.split(","):
    for name, fn, fargs, nbytes in gens[case]():
      try:
        kernels = per_kernel_ms(fn, fargs, args.iters)
        rows.append({"case": case, "impl": name, "bytes": nbytes, "kernels": kernels})
      except Exception as ex:  # noqa: BLE001
        rows.append({"case": case, "impl": name, "error": f"{type(ex).__name__}: {str(ex)[:400]}"})
      print(json.dumps(rows[-1]), flush=True)
      with open(os.path.join(args.out, "kernel_breakdown.json"), "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=1)
  lines = [f"# Per-kernel CUPTI times: {meta['device']}, jax {meta['jax']}, {meta['date']}", "", meta["timing"], "",
           "| impl | MB | total µs | largest kernel | its µs | its TB/s | other kernels µs |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['impl']} | | error: {r['error'][:80]} | | | | |")
      continue
    ks = {k: v for k, v in r["kernels"].items() if k != "total"}
    big = max(ks, key=ks.get)
    lines.append(f"| {r['impl']} | {r['bytes'] / 1e6:.1f} | {r['kernels']['total'] * 1e3:.1f} | {big} | "
                 f"{ks[big] * 1e3:.1f} | {r['bytes'] / ks[big] / 1e9:.2f} | "
                 + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ks.items() if k != big) + " |")
  with open(os.path.join(args.out, "kernel_breakdown.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
