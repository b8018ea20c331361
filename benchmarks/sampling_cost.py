"""What `moe_jax.sampling.sample` costs a decode step at a real vocabulary, next to what it is built from.

Run:  PYTHONPATH=$PWD python3 -m benchmarks.sampling_cost [--out=DIR] [--vocab=151936] [--batches=1,32,128,312]
`sample` sorts each row's whole vocabulary when some row filters by top-k or top-p (`sorted_candidates`), and draws
over the whole rows without a sort otherwise (the serving step skips both when every row is greedy). Timed (jitted,
median wall clock of synced calls) on random float32 logits [B, V]: argmax (a greedy step), `sample` with
temperature only, with top-k 50 and with top-p 0.9, a whole-row categorical draw and `lax.top_k` with k = 64.
`results/sampling_cost_nvidia_h100_80gb_hbm3.*` (2026-12-06) was measured before the whole-row path: its
"temperature 0.8" row is the sorted draw, and the whole-row path is its "categorical over the full row" row.
Writes `sampling_cost_<device>.{json,md}`.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks import report_files
from benchmarks.timing import median_ms
from moe_jax.sampling import sample


def cases(b: int) -> dict:
  """name -> fn(logits [B, V], key) -> int32 [B]."""
  full = lambda t, k, p: (jnp.full((b,), t, jnp.float32), jnp.full((b,), k, jnp.int32), jnp.full((b,), p, jnp.float32))
  return {
      "argmax (greedy)": lambda x, key: jnp.argmax(x, -1).astype(jnp.int32),
      "sample, temperature 0.8": lambda x, key: sample(x, key, *full(0.8, 0, 1.0)),
      "sample, top-k 50": lambda x, key: sample(x, key, *full(0.8, 50, 1.0)),
      "sample, top-p 0.9": lambda x, key: sample(x, key, *full(0.8, 0, 0.9)),
      "categorical over the full row": lambda x, key: jax.random.categorical(key, x / 0.8, -1).astype(jnp.int32),
      "lax.top_k, k = 64": lambda x, key: jax.lax.top_k(x, 64)[1][:, 0],
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--vocab", type=int, default=151936)  # Qwen3's
  p.add_argument("--batches", default="1,32,128,312")
  p.add_argument("--repeats", type=int, default=30)
  a = p.parse_args(argv)
  rows = []
  for b in (int(x) for x in a.batches.split(",")):
    logits = jax.random.normal(jax.random.key(b), (b, a.vocab), jnp.float32) * 3.0
    key = jax.random.key(0)
    for name, fn in cases(b).items():
      f = jax.jit(fn)
      rows.append({"batch": b, "case": name, "ms": median_ms(lambda f=f: f(logits, key), a.repeats)})
      print(rows[-1], flush=True)
  device = jax.devices()[0].device_kind
  batches = sorted({r["batch"] for r in rows})
  names = list(dict.fromkeys(r["case"] for r in rows))
  ms = {(r["case"], r["batch"]): r["ms"] for r in rows}
  lines = [f"# Sampling cost per decode step ({device}, jax {jax.__version__}, V = {a.vocab}, float32 logits)", "",
           f"Median ms of {a.repeats} synced calls.", "", "| case | " + " | ".join(f"B = {b}" for b in batches) + " |",
           "|---|" + "---|" * len(batches)]
  lines += [f"| {n} | " + " | ".join(f"{ms[(n, b)]:.3f}" for b in batches) + " |" for n in names]
  report_files.write(a.out, "sampling_cost", {"vocab": a.vocab, "rows": rows}, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
