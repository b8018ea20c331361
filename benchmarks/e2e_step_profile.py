"""Where one end-to-end decode step spends its time: every GPU kernel of the serving engine's `decode_slots`, by
CUPTI, grouped by kind, next to the step's wall time — the question being whether a small-batch step is bound by
the GPU's kernels or by the gaps between them.

    PYTHONPATH=$PWD python3 benchmarks/e2e_step_profile.py --cases=bf16+bf16:4096:1,int4+oskvp:4096:1 --out=$OUT

Same model, cache and step as `e2e_decode.py` (its flags apply: --config, --layers, --expert_impl, --oskvp_impl;
cases are variant:context:concurrency). Per case: the wall ms of a step (median of --steps, the token copy to the
host included), the number of kernels one step launches, their summed CUPTI time (median over --iters steps), the
gap (wall − kernel sum), and the kernels grouped by name with count and summed µs. Writes e2e_step_profile.{md,json}.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # noqa: E402
from benchmarks import e2e_decode as e2e  # noqa: E402  (defines the shared flags)
from benchmarks.cupti import cupti_kernels, kernel_table  # noqa: E402
from moe_jax.serving import steps  # noqa: E402

flags.DEFINE_integer("iters", 5, "Profiled steps per case (median per kernel).")
FLAGS = flags.FLAGS


def profile_case(model, config, kv: str, context: int, c: int) -> dict:
  """Wall ms per step and the CUPTI kernels of one step of `decode_slots` over c slots at `context`."""
  margin = FLAGS.steps + FLAGS.iters + FLAGS.warmup + 1
  row = e2e.one_row_cache(jax.random.key(1), context - margin, kv=kv, context=context, n_layers=config.n_layers,
                          kv_heads=config.n_kv_heads, head_dim=config.head_dim)
  cache = steps.tile(row, num_slots=c)
  del row
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, c).astype(np.int32)
  active = np.ones((c,), bool)
  temp, top_k, top_p = np.zeros((c,), np.float32), np.zeros((c,), np.int32), np.ones((c,), np.float32)
  key, flat = jax.random.key(0), steps.FlatModel.of(model)
  wall, i = [], 0
  for i in range(FLAGS.warmup + FLAGS.steps):
    t = time.perf_counter()
    nxt, _, cache = steps.decode_slots(flat, cache, tokens, active, key, np.array([i, 0], np.uint32), temp, top_k,
                                       top_p)
    tokens = np.asarray(nxt)
    wall.append(time.perf_counter() - t)
  per_kernel, names = collections.defaultdict(list), None
  for j in range(FLAGS.iters):
    (nxt, _, cache), timings = cupti_kernels(lambda j=j: steps.decode_slots(
        flat, cache, tokens, active, key, np.array([i + 1 + j, 0], np.uint32), temp, top_k, top_p))  # noqa: B023
    tokens = np.asarray(nxt)
    names = [n for n, _ in timings]
    for k, (_, ms) in enumerate(timings):
      per_kernel[k].append(ms)
  del cache
  kernels = [(names[k], statistics.median(per_kernel[k])) for k in range(len(names))]
  wall_ms = float(np.median(wall[FLAGS.warmup:]) * 1e3)
  kernel_ms = sum(ms for _, ms in kernels)
  return dict(step_ms=wall_ms, kernels=len(kernels), kernel_sum_ms=kernel_ms, gap_ms=wall_ms - kernel_ms,
              groups=[[g["kernel"], g["count"], g["ms"]] for g in kernel_table(kernels, top=None)])


def render(meta: dict, rows: list[dict]) -> str:
  out = [f"# One decode step, kernel by kernel: {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
         f"`{meta['config']}` shape, {meta['layers']} layers instantiated, random weights, synthetic cache; "
         f"`{meta['command']}`. Wall = median step time (token copy to the host included); kernels by CUPTI "
         f"(median of {meta['iters']} steps).", "",
         "| variant | context | streams | wall ms | kernels | kernel sum ms | gap ms | kernel share |",
         "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      out.append(f"| {r['variant']} | {r['context']} | {r['concurrency']} | error: {r['error'][:120]} | | | | |")
      continue
    out.append(f"| {r['variant']} | {r['context']} | {r['concurrency']} | {r['step_ms']:.3f} | {r['kernels']} | "
               f"{r['kernel_sum_ms']:.3f} | {r['gap_ms']:.3f} | {100 * r['kernel_sum_ms'] / r['step_ms']:.0f}% |")
  for r in rows:
    if "groups" not in r:
      continue
    out += ["", f"## {r['variant']}, {r['context']} context, {r['concurrency']} streams: kernels by group", "",
            "| kernel group | count | µs (sum) | share of kernel time |", "|---|---|---|---|"]
    out += [f"| `{n}` | {cnt} | {1e3 * ms:.1f} | {100 * ms / r['kernel_sum_ms']:.1f}% |" for n, cnt, ms in r["groups"]]
  return "\n".join(out) + "\n"


def main(argv):
  del argv
  base = configs.get(FLAGS.config)
  cases = sorted(e2e.parse_cases(FLAGS.cases), key=lambda c: (c[1], c[2], c[0]))
  if not cases:
    raise app.UsageError("--cases is required, e.g. --cases=bf16+bf16:4096:1,int4+oskvp:4096:1")
  layers = min(FLAGS.layers or base.n_layers, base.n_layers)
  config = base.replace(n_layers=layers, max_seq_len=max(base.max_seq_len, max(c for _, c, _ in cases)))
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              device=jax.devices()[0].device_kind, jax=jax.__version__, config=base.name, layers=layers,
              iters=FLAGS.iters, command=" ".join(sys.argv), xla_flags=os.environ.get("XLA_FLAGS", ""))
  rows, models = [], {}
  os.makedirs(FLAGS.out, exist_ok=True)
  for variant, context, c in cases:
    eq, _, kv = variant.partition("+")
    row = dict(variant=variant, context=context, concurrency=c)
    try:
      if eq not in models:
        models[eq] = e2e.build_model(config, eq)
      row.update(profile_case(models[eq], config, e2e.kv_mode_name(kv or "bf16"), context, c))
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {e}"
    rows.append(row)
    print({k: v for k, v in row.items() if k != "groups"}, flush=True)
    with open(os.path.join(FLAGS.out, "e2e_step_profile.json"), "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(FLAGS.out, "e2e_step_profile.md"), "w") as f:
      f.write(render(meta, rows))
  print(render(meta, rows))


if __name__ == "__main__":
  app.run(main)
