"""Greedy equality under load in bf16: 1,000 mixed-length requests at concurrency 312 through the serving engine,
each against the same request decoded alone, with the near-tie rule of `moe_jax.serving.equality`.

    PYTHONPATH=$PWD python3 benchmarks/serving_equality.py --out=$OUT                  # H200, ~1-2 min
    JAX_PLATFORMS=cpu python benchmarks/serving_equality.py --smoke --out=/tmp/eq      # CPU smoke test, ~1 min

Per model (`--models`: the shipped `tiny-trained` checkpoint in bf16, and `random:<preset>`, a preset with random
bf16 weights, whose flat logits make near-ties common):
  * the engine (`--concurrency` slots, bf16 cache, bucketed and chunked prefill) runs all requests, submitted at once;
  * each request is decoded alone (`equality.run_alone`: a batch of one, one-shot prefill, greedy);
  * reported: requests completed exactly once, outputs exactly equal, and for each divergence its position, the
    alone run's top-1 minus top-2 logit and top-1 minus the engine token's logit, the bound tau, the router margins
    at that token, and which near-tie explains it (or none);
  * base rates: the fraction of all alone positions that are near-ties (the chance a divergence at a random
    position would pass the rule);
  * the noise probe (`equality.batch_noise`): the same requests decoded `--concurrency` at a time, fed the alone
    tokens; |change of the top-1 minus top-2 logit| / tau at every position, split by routing.

Prompts are windows of the stdlib validation split (`moe_jax.data`), 1..`--max_prompt` tokens; max_tokens is
1..`--max_new`; every 4th request also stops at a newline. Writes serving_equality.md / .json to `--out`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # noqa: E402
from moe_jax import checkpoints, data, decode  # noqa: E402
from moe_jax.serving import EngineConfig  # noqa: E402
from moe_jax.serving import equality as eq  # noqa: E402

flags.DEFINE_list("models", ["tiny-trained", "random:tiny"], "Checkpoints (loaded in bf16) or random:<preset>.")
flags.DEFINE_integer("requests", 1000, "Requests per model.")
flags.DEFINE_integer("concurrency", 312, "Engine slots (and the noise probe's batch).")
flags.DEFINE_integer("max_prompt", 120, "Longest prompt (longer than the largest prefill bucket: chunked).")
flags.DEFINE_integer("max_new", 32, "Most tokens a request asks for.")
flags.DEFINE_integer("cache_len", 160, "Positions per slot.")
flags.DEFINE_list("prefill_lengths", ["16", "32", "64"], "Engine prefill buckets.")
flags.DEFINE_list("prefill_batches", ["8", "64"], "Engine prefill batch sizes.")
flags.DEFINE_string("kv_cache", "bf16", "Cache mode of the engine and of the alone runs.")
flags.DEFINE_integer("alone_bucket", 32, "Smallest prompt bucket of the alone runs (fewer compiled shapes).")
flags.DEFINE_bool("noise", True, "Run the batch-noise probe.")
flags.DEFINE_bool("smoke", False, "Tiny sizes for a CPU check of the script (overrides the sizes above).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("out", "benchmarks/results", "Output folder.")
FLAGS = flags.FLAGS


def load_model(spec: str):
  if spec.startswith("random:"):
    config = configs.get(spec.split(":", 1)[1]).replace(param_dtype="bfloat16")
    return config, decode.init_model(config, seed=0)
  return checkpoints.load(spec, param_dtype="bfloat16")


def run_model(spec: str, sizes: dict, text: np.ndarray) -> dict:
  t0 = time.perf_counter()
  config, model = load_model(spec)
  workload = eq.make_workload(sizes["requests"], text, max_prompt=sizes["max_prompt"], max_new=sizes["max_new"],
                              seed=FLAGS.seed)
  engine_config = EngineConfig(num_slots=sizes["concurrency"], cache_len=sizes["cache_len"], kv_cache=FLAGS.kv_cache,
                               prefill_lengths=sizes["prefill_lengths"], prefill_batches=sizes["prefill_batches"],
                               max_queue=sizes["requests"])
  engine = eq.run_engine(model, workload, engine_config)
  t_engine = time.perf_counter()
  alone = eq.run_alone(model, workload, engine["tokens"], kv_cache=FLAGS.kv_cache, cache_len=sizes["cache_len"],
                       max_new=sizes["max_new"], smallest_bucket=FLAGS.alone_bucket)
  t_alone = time.perf_counter()
  report = eq.compare(workload, engine, alone, model, kv_cache=FLAGS.kv_cache, cache_len=sizes["cache_len"],
                      max_new=sizes["max_new"])
  noise = None
  if FLAGS.noise:
    noise = eq.batch_noise(model, workload, alone, batch=sizes["concurrency"], kv_cache=FLAGS.kv_cache,
                           cache_len=sizes["cache_len"], max_new=sizes["max_new"])
  t_end = time.perf_counter()
  report.update(model=spec, config=config.name, dtype=str(config.dtype), engine=dict(
      max_active=engine["max_active"], decode_steps=engine["decode_steps"],
      traces_after_warmup=engine["traces_after_warmup"],
      finish_reasons={r: engine["finish_reason"].count(r) for r in set(engine["finish_reason"])}),
      noise=noise, prompt_tokens=int(sum(len(p) for p in workload.prompts)),
      seconds=dict(engine=t_engine - t0, alone=t_alone - t_engine, noise=t_end - t_alone))
  print(json.dumps({k: v for k, v in report.items() if k != "divergences"}, indent=1), flush=True)
  return report


def _verdict(r: dict) -> str:
  k = r["kinds"]
  if not r["divergences"]:
    return "no divergence"
  if k[eq.UNEXPLAINED]:
    return f"**fails: {k[eq.UNEXPLAINED]} unexplained**"
  if k[eq.ROUTER] == 0:
    return f"holds: all {len(r['divergences'])} divergences start at a logit near-tie"
  return f"holds: {k[eq.LOGIT]} logit and {k[eq.ROUTER]} router near-ties"


def _flips(d: dict) -> str:
  """The router counterfactuals tried for a divergence, e.g. ' (layer 3 flipped: top-1 − engine 0.00 <= tau)'."""
  tried = d.get("router_flips") or []
  return "".join(f" (layer {f['layer']} flipped: top-1 − engine {f['top1_minus_engine']:.3g} "
                 f"{'<=' if f['reproduces'] else '>'} tau {f['tau']:.3g})" for f in tried)


def write(out_dir: str, meta: dict, results: list[dict]) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "serving_equality.json"), "w") as f:
    json.dump(dict(meta=meta, results=results), f, indent=2)
  s = meta["sizes"]
  lines = [
      f"# Serving: greedy equality under load in bf16 ({meta['date']}, {meta['device']}, jax {meta['jax']})", "",
      f"{s['requests']} greedy requests per model through the serving engine at concurrency {s['concurrency']} "
      f"({meta['kv_cache']} cache, {s['cache_len']} positions per slot, prefill buckets {s['prefill_lengths']} × "
      f"batches {s['prefill_batches']}, longer prompts chunked), all submitted at once; prompts are "
      f"1..{s['max_prompt']} tokens of the stdlib validation split, max_tokens 1..{s['max_new']}, every 4th "
      "request also stops at a newline. Each output is compared with the same request decoded **alone**: a batch "
      "of one, prefilled in one shot (padded to its own power-of-two bucket) and decoded greedily through the "
      "model's layers, same cache mode and length, no other request in any matmul or MoE group.", "",
      "**Tolerance.** A divergence must start at a near-tie of the alone run: at the first divergent position, "
      "l_a - l_e <= tau = 2^-7 · Σ_d |h_d| · |W[d,a] - W[d,e]| (a: the alone token, e: the engine token, h: the "
      "bf16 LM-head input, W: the LM head). The logits are float32 sums of exact bf16 products, so the runs differ "
      "only through h; two bf16 roundings of nearly equal values differ by at most one ulp = 2^-7 of the value, and "
      "one ulp on every element of h with the worst signs moves l_a - l_e by at most tau. The top-1 minus top-2 gap "
      "is then below tau too. The MoE's top-k choice is the other discrete decision: a divergence that is not a "
      "logit near-tie counts as a **router near-tie** when, at the token that produced the divergent logits, some "
      "MoE layer's k-th minus (k+1)-th router logit is <= tau_r (the same one-ulp bound on the router's input) and "
      "switching that layer to its runner-up expert makes the engine's token a logit near-tie (or the top-1) of the "
      "alone run. Any other divergence is a failure.", "",
      "| model | completed exactly once | exactly equal | divergences | logit near-tie | router near-tie | "
      "unexplained | rule | positions that are logit near-ties | max active slots | compiles after warm-up |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    k = r["kinds"]
    lines.append(
        f"| {r['model']} | {r['completed_once']}/{r['n']} | {r['exact']}/{r['n']} ({r['exact_fraction']:.1%}) | "
        f"{len(r['divergences'])} | {k[eq.LOGIT]} | {k[eq.ROUTER]} | {k[eq.UNEXPLAINED]} | {_verdict(r)} | "
        f"{r['logit_near_tie_rate']:.2%} of {r['positions']:,} | {r['engine']['max_active']} | "
        f"{r['engine']['traces_after_warmup']} |")
  for r in results:
    lines += ["", f"## {r['model']} ({r['dtype']}): divergences", ""]
    if r["divergences"]:
      lines += ["| request | prompt len | position | alone token | engine token | top-1 − top-2 | top-1 − engine "
                "| tau | (top-1 − engine)/tau | router margin/tau_r per MoE layer | kind |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
      for d in r["divergences"]:
        if "tau" not in d:
          lines.append(f"| {d['request']} | {d['prompt_len']} | {d['position']} | | | | | | | | {d['kind']}: "
                       f"{d.get('note', '')} |")
          continue
        lines.append(
            f"| {d['request']} | {d['prompt_len']} | {d['position']} | {d['alone_token']} | {d['engine_token']} | "
            f"{d['top1_minus_top2']:.4g} | {d['top1_minus_engine']:.4g} | {d['tau']:.4g} | {d['gap_over_tau']:.3f} | "
            f"{', '.join(f'{x:.2f}' for x in d['router_margin_over_tau'])} | {d['kind']}"
            f"{_flips(d)} |")
    else:
      lines.append("None.")
    taus = [d["tau"] for d in r["divergences"] if "tau" in d]
    lines += ["", f"Base rates over {r['positions']:,} alone positions: the top-1/top-2 gap is below tau at "
              f"{r['logit_near_tie_rate']:.2%}, some MoE layer's router margin is below tau_r at "
              f"{r['router_near_tie_rate']:.2%} (the router needs the counterfactual too). tau at the divergences: "
              f"{min(taus):.3g}..{max(taus):.3g} logits." if taus else
              f"Base rates over {r['positions']:,} alone positions: logit near-tie {r['logit_near_tie_rate']:.2%}, "
              f"router {r['router_near_tie_rate']:.2%}."]
    if r.get("noise"):
      n = r["noise"]
      lines += ["", f"Noise probe (the same requests {s['concurrency']} at a time, fed the alone tokens): |change of "
                f"top-1 − top-2| / tau; router decisions that differ from alone: {n['routing_flip_rate']:.3%}.", "",
                "| positions | count | p50 | p99 | p99.9 | max |", "|---|---|---|---|---|---|"]
      for split in ("same routing", "earlier flip", "flip here"):
        x = n[split]
        if x["positions"]:
          lines.append(f"| {split} | {x['positions']:,} | {x['p50']:.3f} | {x['p99']:.3f} | {x['p999']:.3f} | "
                       f"{x['max']:.3f} |")
        else:
          lines.append(f"| {split} | 0 | | | | |")
    lines += ["", f"Time: engine {r['seconds']['engine']:.1f} s (with warm-up), alone {r['seconds']['alone']:.1f} s, "
              f"noise probe {r['seconds']['noise']:.1f} s."]
  lines += ["", f"Command: `{meta['command']}`"]
  with open(os.path.join(out_dir, "serving_equality.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines), flush=True)


def main(argv):
  del argv
  sizes = dict(requests=FLAGS.requests, concurrency=FLAGS.concurrency, max_prompt=FLAGS.max_prompt,
               max_new=FLAGS.max_new, cache_len=FLAGS.cache_len,
               prefill_lengths=tuple(int(x) for x in FLAGS.prefill_lengths),
               prefill_batches=tuple(int(x) for x in FLAGS.prefill_batches))
  if FLAGS.smoke:
    sizes = dict(requests=24, concurrency=8, max_prompt=40, max_new=8, cache_len=64, prefill_lengths=(16, 32),
                 prefill_batches=(8,))
  if sizes["max_prompt"] + sizes["max_new"] > sizes["cache_len"]:
    raise ValueError(f"max_prompt + max_new = {sizes['max_prompt'] + sizes['max_new']} must fit "
                     f"cache_len={sizes['cache_len']}")
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
              kv_cache=FLAGS.kv_cache, rho=eq.RHO, sizes=sizes, seed=FLAGS.seed, command=" ".join(sys.argv))
  print(meta, flush=True)
  text = data.load_corpus()["validation"].tokens
  results = []
  for spec in FLAGS.models:
    results.append(run_model(spec, sizes, text))
    write(FLAGS.out, meta, results)


if __name__ == "__main__":
  app.run(main)
