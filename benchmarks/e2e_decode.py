"""End-to-end decode on one GPU: the serving engine's decode step over C slots at a 4k and a 32k context, bf16
experts + bf16 cache against quantized experts + OS-KVP cache, next to the roofline; and what that projects to for
the seed_480b preset on 8 GPUs.

    PYTHONPATH=$PWD python3 benchmarks/e2e_decode.py --out=$OUT                       # H200, ~5 min
    PYTHONPATH=$PWD python3 benchmarks/e2e_decode.py --variants=int4_mgpu+oskvp,int4_mgpu_gu+oskvp \\
        --out=$OUT                                   # Mosaic int4 experts: gate/up as two calls vs one fused call
    JAX_PLATFORMS=cpu python benchmarks/e2e_decode.py --config=tiny --contexts=64,128 --concurrency=1,4 \\
        --steps=2 --full_depth_check=false --out=/tmp/e2e                              # CPU smoke test

One case again, merged into an earlier results file (its other rows kept, each row labelled with the run it came
from; the projection recomputed from the merged rows, each at its own run's copy bandwidth):

    PYTHONPATH=$PWD python3 benchmarks/e2e_decode.py --cases=bf16+bf16:32768:312 --steps=8 \\
        --full_depth_check=false --merge_into=benchmarks/results/e2e_decode.json --out=$OUT

The script exits with status 1 when a case named in `--cases` failed or did not run, so a command can retry it, e.g.
with GEMM autotuning off (`XLA_FLAGS=--xla_gpu_autotune_level=0`, recorded in the run's meta).

Memory at 312 streams × 32k (bf16, 4 layers): the cache alone is 84 GB. The first H200 run used jax's default
pool (75% of the GPU); XLA's GEMM autotuner then had no room for its copies of the attention operands (each ~10 GB)
and failed ("Failed to get configs for: 4 out of 58 instructions"). The pool is now 95% of the GPU
(XLA_PYTHON_CLIENT_MEM_FRACTION below), and a `--cases` run builds only the variants it needs.

What is timed: `moe_jax.serving.steps.decode_slots` (the engine's one compiled step: embed, every block's attention
over its cache and MoE, LM head, NaN check, greedy token) over C slots, all active, each step followed by the
device-to-host copy of the C tokens as the engine does; the median over `--steps` steps after warm-up.

Model: the `--config` shape (Qwen3-30B-A3B by default) with random bf16 weights initialised on the device under jit,
cut to `--layers` blocks so that the largest cache (312 streams × 32k positions) fits next to the weights; a
full-depth model would need 48 × 20.9 GB of bf16 cache at 312 × 32k. The per-layer time is scaled to full depth:
t_full = t_head + (t_step - t_head) · n_layers / layers, where t_head (embedding, final norm, LM head, argmax) is
timed on its own at each C. `--full_depth_check` times one case with all layers to test that scaling.

Cache content is synthetic: for each context, one sequence of random post-RoPE keys and values (std 1) of the
context's length is put through the mode's own `from_prefill` (so an OS-KVP cache really is fitted and quantized),
then copied into all C slots; lengths = context - (steps + warm-up) so the timed steps stay inside the cache. No 32k
prefill runs (it would take minutes per slot batch); the decode step reads the same bytes either way.

Roofline: bytes a step must read (non-expert weights, the distinct experts C tokens touch — expected count under
uniform routing — at their stored size, LM head, and the whole cache as stored) ÷ the copy bandwidth measured in the
same run (best of bf16 x*2 and f32 x+1 over 2 GiB, read + write counted).
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import sys
import time
import traceback

# The largest cache (312 × 32k positions × 4 layers, bf16: 84 GB) and XLA attention's float32 temporaries need more
# than jax's default 75% of GPU memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # noqa: E402
from benchmarks.timing import median_ms  # noqa: E402
from moe_jax import decode  # noqa: E402
from moe_jax.config import analytical_report, param_counts  # noqa: E402
from moe_jax.kv_cache import KVCache, get_kv_cache_mode, register_kv_cache_mode  # noqa: E402
from moe_jax.serving import steps  # noqa: E402

flags.DEFINE_string("config", "qwen3_30b_a3b", "Preset whose shape is benchmarked (random weights).")
flags.DEFINE_integer("layers", 4, "Blocks instantiated (0: the preset's full depth).")
flags.DEFINE_list("contexts", ["4096", "32768"], "Cache positions per stream.")
flags.DEFINE_list("concurrency", ["1", "32", "128", "312"], "Streams decoded together (slots).")
flags.DEFINE_list("variants", ["bf16+bf16", "int4+oskvp"],
                  "expert_quant+kv_cache pairs; expert_quant 'bf16' keeps the weights, 'int4_mgpu' is int4 in the "
                  "warp-specialized Mosaic kernel's layout, 'int4_mgpu_gu' the same with gate and up fused into one "
                  "weight (one swiglu=True call per layer), 'vq2_mgpu' vq2 in the Mosaic vq2 kernel's layout, else a "
                  "mode of moe_jax.quant.quantize_experts.")
flags.DEFINE_string("expert_impl", "pallas", "Grouped matmul of quantized experts ('pallas' reads them compressed).")
flags.DEFINE_string("oskvp_impl", "pallas", "Decode attention of OS-KVP caches ('pallas' or 'xla').")
flags.DEFINE_list("mgpu_options", [], "Kernel options of the int4_mgpu(_gu) / vq2_mgpu variants' experts, "
                  "name=value (Python literals), passed to quant.to_mgpu_layout: e.g. block_r=32.")
flags.DEFINE_integer("steps", 16, "Timed decode steps per case (median).")
flags.DEFINE_integer("warmup", 2, "Untimed steps per case (the first compiles).")
flags.DEFINE_bool("full_depth_check", True, "Also time bf16 at the first context and concurrency <= 32 with all "
                  "layers, to test the depth scaling.")
flags.DEFINE_float("time_budget_s", 285.0, "Cases not started within this many seconds are skipped (and listed).")
flags.DEFINE_string("out", "benchmarks/results", "Output folder for e2e_decode.md / .json.")
flags.DEFINE_list("cases", [], "Only these cases, each variant:context:concurrency (e.g. bf16+bf16:32768:312); "
                  "overrides --variants, --contexts and --concurrency.")
flags.DEFINE_string("merge_into", "", "An earlier e2e_decode.json: its rows are kept, those of the cases run here "
                    "replaced; the merged file is written to --out.")
FLAGS = flags.FLAGS

SEED_CLAIM_MS = 2.8  # the seed: 2.8 ms/token at 312 concurrent streams, 480B model, 8 GPUs
SEED_STREAMS, SEED_GPUS = 312, 8


def parse_cases(specs: list[str]) -> set[tuple[str, int, int]]:
  """["bf16+bf16:32768:312", ...] -> {(variant, context, concurrency), ...}."""
  out = set()
  for spec in specs:
    parts = spec.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
      raise ValueError(f"--cases entry {spec!r} must be variant:context:concurrency, e.g. bf16+bf16:32768:312")
    out.add((parts[0], int(parts[1]), int(parts[2])))
  return out


def copy_bandwidth(nbytes: int) -> dict:
  """Bytes/s of elementwise copies (read + write) over `nbytes` of input."""
  out = {}
  for name, dtype, fn in (("bf16 x*2", jnp.bfloat16, lambda a: a * 2), ("f32 x+1", jnp.float32, lambda a: a + 1)):
    x, f = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype), jax.jit(fn)
    ms = median_ms(lambda: f(x), 10)  # noqa: B023
    out[name] = 2 * x.nbytes / (ms / 1e3)
    del x
  return out


def build_model(config, expert_quant: str):
  """Random bf16 weights created on the device under jit; quantized experts when expert_quant != 'bf16'."""
  model = nnx.jit(lambda: decode.init_model(config, seed=0))()
  jax.block_until_ready(nnx.state(model))
  if expert_quant != "bf16":
    from moe_jax import quant  # pylint: disable=g-import-not-at-top
    # "int4_mgpu": int4 re-laid for the warp-specialized Mosaic GPU kernel (`quant.to_mgpu_layout`); "int4_mgpu_gu":
    # the same with each layer's gate and up stored as one interleaved weight (`fuse_gate_up=True`); "vq2_mgpu": vq2
    # re-laid for the Mosaic GPU vq2 kernel.
    mgpu = expert_quant in ("int4_mgpu", "int4_mgpu_gu", "vq2_mgpu")
    base = {"vq2_mgpu": "vq2"}.get(expert_quant, "int4") if mgpu else expert_quant
    quant.quantize_experts(model, base, implementation=FLAGS.expert_impl)
    if mgpu:
      quant.to_mgpu_layout(model, fuse_gate_up=expert_quant == "int4_mgpu_gu",
                           **quant.parse_kernel_options(FLAGS.mgpu_options, "--mgpu_options"))
    jax.block_until_ready(nnx.state(model))
  return model


def kv_mode_name(kv: str, implementation: str | None = None) -> str:
  """The OS-KVP modes with the requested decode-attention implementation, registered under a new name."""
  implementation = implementation or FLAGS.oskvp_impl
  mode = get_kv_cache_mode(kv)
  if kv.startswith("oskvp") and getattr(mode, "implementation", implementation) != implementation:
    import dataclasses  # pylint: disable=g-import-not-at-top
    name = f"{kv}_{implementation}"
    register_kv_cache_mode(name, dataclasses.replace(mode, implementation=implementation))
    return name
  return kv


def uses_pallas(expert_quant: str, kv: str) -> bool:
  return (expert_quant != "bf16" and FLAGS.expert_impl != "xla") or getattr(
      get_kv_cache_mode(kv), "implementation", "xla") == "pallas"


@functools.partial(jax.jit, static_argnames=("kv", "context", "n_layers", "kv_heads", "head_dim"))
def one_row_cache(key, length, *, kv: str, context: int, n_layers: int, kv_heads: int, head_dim: int) -> KVCache:
  """One sequence's cache of `context` positions from random keys/values through the mode's `from_prefill`."""
  mode = get_kv_cache_mode(kv)
  lengths = jnp.full((1,), length, jnp.int32)
  layers = []
  for i in range(n_layers):
    kk, kv_ = jax.random.split(jax.random.fold_in(key, i))
    k = jax.random.normal(kk, (1, context, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(kv_, (1, context, kv_heads, head_dim), jnp.bfloat16)
    layers.append(mode.from_prefill(k, v, lengths, context, layer=i))
  return KVCache(layers=tuple(layers), lengths=lengths, mode=kv)


def expert_bytes_per_expert(model) -> float:
  """Stored bytes of one routed expert (gate + up + down), quantized or not (`quant.expert_bytes`: int4 packed two
  per byte)."""
  from moe_jax.quant.experts import expert_bytes, moe_layers  # pylint: disable=g-import-not-at-top
  moes = [m for m in moe_layers(model) if m is not None]
  return expert_bytes(model) / (len(moes) * moes[0].n_experts)


def step_bytes(config, model, c: int, cache_bytes: int) -> dict:
  """Bytes one decode step over c tokens must read, by part."""
  counts = param_counts(config)
  n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
  per_expert = expert_bytes_per_expert(model)
  touched = config.n_experts * (1 - (1 - config.n_experts_per_tok / config.n_experts) ** c)
  other = counts["active"] - n_moe * config.n_experts_per_tok * counts["per_expert"]  # attn, router, head, ...
  return dict(other_weights=other * 2.0, experts=n_moe * touched * per_expert, kv=float(cache_bytes),
              experts_touched_per_layer=touched, bytes_per_expert=per_expert)


@jax.jit
def head_only(flat, tokens):
  """Embedding, final norm, LM head and argmax of [C] tokens: the part of a step that does not scale with depth."""
  model = flat.unflatten()
  x = model.embed(tokens[:, None])
  return jnp.argmax(model.unembed(x)[:, 0], axis=-1)


def time_case(model, config, kv: str, context: int, c: int) -> dict:
  """Builds a C-slot cache at `context` and times the engine's decode step over it."""
  margin = FLAGS.steps + FLAGS.warmup + 1
  row = one_row_cache(jax.random.key(1), context - margin, kv=kv, context=context, n_layers=config.n_layers,
                      kv_heads=config.n_kv_heads, head_dim=config.head_dim)
  cache = steps.tile(row, num_slots=c)
  del row
  cache_bytes = cache.nbytes()
  runs_core = getattr(cache.layers[0], "runs_mosaic_core", None)
  attention = "mosaic_core" if runs_core is not None and runs_core(config.n_heads) else "other"
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, c).astype(np.int32)
  active = np.ones((c,), bool)
  temp, top_k, top_p = np.zeros((c,), np.float32), np.zeros((c,), np.int32), np.ones((c,), np.float32)
  key = jax.random.key(0)
  flat = steps.FlatModel.of(model)  # as the engine passes it
  t0 = time.perf_counter()
  times = []
  for i in range(FLAGS.warmup + FLAGS.steps):
    t = time.perf_counter()
    nxt, finite, cache = steps.decode_slots(flat, cache, tokens, active, key, np.array([i, 0], np.uint32), temp,
                                            top_k, top_p)
    tokens = np.asarray(nxt)  # the engine's device-to-host copy of the step's tokens
    times.append(time.perf_counter() - t)
    if i == 0:
      compile_s = time.perf_counter() - t0
  ok = bool(np.asarray(finite).all())
  del cache
  # Median of 21 calls: the full-depth column scales the step less this head by 12 for 48 layers, and a median of 5
  # read 0.57-1.72 ms on one H100 (results/e2e_decode_uniform_h100_s47.md), 0.56-0.78 with 21 (_s47b.md).
  head_ms = median_ms(lambda: head_only(flat, tokens), 21)
  return dict(step_ms=float(np.median(times[FLAGS.warmup:]) * 1e3), step_ms_mean=float(np.mean(
      times[FLAGS.warmup:]) * 1e3), head_ms=head_ms, first_step_s=compile_s, cache_bytes=cache_bytes,
              finite=ok, attention=attention)


def projection(measured: list[dict], bw: float, spec_bw: float = 4.8e12) -> list[dict]:
  """seed_480b on 8 GPUs at 312 streams, from our fraction of the roofline at 312 streams (per variant, context)."""
  seed = configs.get("seed_480b")
  rep = analytical_report(seed)
  counts = param_counts(seed)
  n_moe = sum(seed.is_moe_layer(i) for i in range(seed.n_layers))
  touched = seed.n_experts * (1 - (1 - seed.n_experts_per_tok / seed.n_experts) ** SEED_STREAMS)
  other = counts["active"] - n_moe * seed.n_experts_per_tok * counts["per_expert"]
  done = [r for r in measured if "step_ms" in r]
  if not done:
    return []
  base_c = SEED_STREAMS if any(r["concurrency"] == SEED_STREAMS for r in done) else max(r["concurrency"] for r in done)
  out = []
  for r in done:
    if r["concurrency"] != base_c:
      continue
    expert_bpw = r["bytes"]["bytes_per_expert"] / r["params_per_expert"]
    kv_ratio = r["cache_bytes"] / (r["concurrency"] * r["context"] * r["layers"] * r["kv_bytes_per_token_per_layer"])
    weights = other * 2.0 + n_moe * touched * counts["per_expert"] * expert_bpw
    kv = SEED_STREAMS * r["context"] * rep["kv_bytes_per_token_bf16"] * kv_ratio
    per_gpu = (weights + kv) / SEED_GPUS
    frac = r["fraction_of_roofline"]
    bw = r.get("copy_bandwidth_tb_s", bw / 1e12) * 1e12  # the bandwidth of the run the row came from
    out.append(dict(variant=r["variant"], context=r["context"], from_concurrency=base_c, per_gpu_bytes=per_gpu,
                    weights_bytes=weights,
                    kv_bytes=kv, expert_bytes_per_weight=expert_bpw, kv_bytes_vs_bf16=kv_ratio,
                    fraction_of_roofline=frac, projected_ms=per_gpu / (bw * frac) * 1e3,
                    roofline_ms_measured_bw=per_gpu / bw * 1e3, roofline_ms_spec_bw=per_gpu / spec_bw * 1e3,
                    seed_claim_ms=SEED_CLAIM_MS))
  return out


def _bytes(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _run_label(i: int) -> str:
  return chr(ord("A") + i)


def merge_runs(old: dict, meta: dict, rows: list[dict], skipped: list[str]):
  """An earlier results file (`old`, as written by `write`) with this run's rows: a row of the same (variant,
  context, concurrency) replaces the earlier one, the others stay. Returns (runs, rows, skipped); each row's "run"
  indexes runs, and carries its run's copy bandwidth."""
  runs = [dict(r) for r in old.get("runs") or [old["meta"]]]
  key = lambda r: (r["variant"], r["context"], r["concurrency"])  # noqa: E731
  kept = []
  for r in old["rows"]:
    r = dict(r, run=r.get("run", 0))
    r.setdefault("copy_bandwidth_tb_s", runs[r["run"]]["copy_bandwidth_tb_s"])
    kept.append(r)
  new = {key(r): dict(r, run=len(runs)) for r in rows}
  notes = [f"replaced: {r['variant']} context={r['context']} C={r['concurrency']} failed in run "
           f"{_run_label(r['run'])} ({r['error']}), re-run in run {_run_label(len(runs))}"
           for r in kept if key(r) in new and "error" in r]
  merged = [new.pop(key(r), r) for r in kept] + list(new.values())
  redone = {f"{v} context={c} C={n}" for v, c, n in map(key, rows)}
  earlier = [x for x in old.get("skipped", []) if x.split(":")[0] not in redone]
  return runs + [meta], merged, earlier + notes + skipped


def write(out_dir: str, runs: list[dict], rows: list[dict], proj: list[dict], skipped: list[str]) -> None:
  """e2e_decode.json and .md; `runs` holds each run's meta (the last is this run's), rows[i]["run"] indexes it."""
  meta = runs[-1]
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "e2e_decode.json"), "w") as f:
    json.dump(dict(meta=meta, runs=runs, rows=rows, seed_480b_projection=proj, skipped=skipped), f, indent=2)
  full, layers = meta["full_layers"], runs[0]["layers"]  # a row instantiated at another depth says so
  if len(runs) == 1:
    title = f"{meta['date']}, {meta['device']}, jax {meta['jax']}"
    bw_text = f"Copy bandwidth in this run: {meta['copy_bandwidth_tb_s']:.2f} TB/s ({meta['copy_probe']})."
  else:
    title = f"{meta['device']}, jax {meta['jax']}, rows from {len(runs)} runs"
    bw_text = "Runs (column \"run\"; each row's roofline uses its own run's copy bandwidth): " + "; ".join(
        f"**{_run_label(i)}** {m['date']}, {m['device']}, jax {m['jax']}, copy bandwidth "
        f"{m['copy_bandwidth_tb_s']:.2f} TB/s ({m['copy_probe']}), median of {m['steps']} steps, "
        + (f"XLA_FLAGS={m['xla_flags'] or '(none)'}, GPU memory fraction {m['mem_fraction']}" if "mem_fraction" in m
           else "XLA_FLAGS and memory fraction not recorded (the script then set neither: jax's default 0.75)")
        + f", `{m['command']}`" for i, m in enumerate(runs)) + "."
  lines = [
      f"# End-to-end decode ({title})", "",
      f"Model: `{meta['config']}` shape, random bf16 weights, **{layers} of {full} layers** instantiated "
      f"(times scaled to {full} layers: t_head + (t_step - t_head)·{full}/{layers}). Step = the serving "
      f"engine's `decode_slots` over C active slots + the token copy to the host; median of {meta['steps']} steps. "
      f"{bw_text} Cache content "
      "synthetic (random keys/values through the mode's from_prefill, copied to every slot).", "",
      "| variant | context | C | step ms (measured, L layers) | ms/token at full depth | tokens/s at full depth "
      "| roofline ms (L layers) | roofline/measured | KV bytes (L layers) | head ms | run |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    run = _run_label(r.get("run", 0))
    if "step_ms" not in r:
      lines.append(f"| {r['variant']} | {r['context']} | {r['concurrency']} | {r.get('error', 'skipped')} |"
                   f" | | | | | | {run} |")
      continue
    name = r["variant"] + (" (XLA fallback)" if "fallback" in r else "") + (
        " (Mosaic GPU core)" if r.get("attention") == "mosaic_core" else "") + (
        f" ({r['layers']} layers)" if r["layers"] != layers else "")
    lines.append(
        f"| {name} | {r['context']} | {r['concurrency']} | {r['step_ms']:.2f} | {r['full_depth_ms']:.2f} | "
        f"{r['concurrency'] / r['full_depth_ms'] * 1e3:,.0f} | {r['roofline_ms']:.2f} | "
        f"{r['fraction_of_roofline']:.0%} | {_bytes(r['cache_bytes'])} | {r['head_ms']:.2f} | {run} |")
  if meta.get("full_depth_check"):
    fc = meta["full_depth_check"]
    lines += ["", f"Full-depth check ({fc['variant']}, context {fc['context']}, C={fc['concurrency']}, all "
              f"{full} layers): measured {fc.get('step_ms', float('nan')):.2f} ms vs "
              f"{fc.get('scaled_ms', float('nan')):.2f} ms scaled from {meta['layers']} layers. "
              f"{fc.get('error', '')}"]
  if proj:
    lines += ["", f"## Projection to seed_480b (8 GPUs, 312 streams; roofline fraction taken from our C="
              f"{proj[0]['from_concurrency']} rows)", "",
              "| variant | context | bytes/GPU/step | roofline ms @ measured bw | roofline ms @ 4.8 TB/s "
              "| our roofline fraction | projected ms/token | seed claim |", "|---|---|---|---|---|---|---|---|"]
    for p in proj:
      lines.append(f"| {p['variant']} | {p['context']} | {p['per_gpu_bytes'] / 1e9:.1f} GB | "
                   f"{p['roofline_ms_measured_bw']:.2f} | {p['roofline_ms_spec_bw']:.2f} | "
                   f"{p['fraction_of_roofline']:.0%} | {p['projected_ms']:.2f} | {p['seed_claim_ms']} |")
    lines += ["", "Bytes/GPU/step = (non-expert weights at bf16 + 62 layers × experts touched × bytes/expert at the "
              "variant's measured bytes/weight + 312 × context × KV bytes/token at the variant's measured ratio to "
              "bf16) / 8."]
    lines += ["", "Assumes: the 480B model's bytes split evenly over 8 GPUs (experts sharded expert-parallel, "
              "attention and KV heads tensor-parallel, LM head sharded), uniform routing (312 tokens × 32 of 256 "
              "experts touch all of them every layer), expert bytes/weight and KV bytes/position as measured here, "
              "the same fraction of the copy-bandwidth roofline as our single-GPU step at 312 streams, and zero "
              "time for all-to-all / collectives (not overlapped in our code: a lower bound on real time)."]
  fallbacks = sorted({f"{r['variant']}: {r['fallback']}" for r in rows if "fallback" in r})
  if fallbacks:
    lines += ["", "Pallas paths that failed and were re-run on XLA: " + "; ".join(fallbacks)]
  replaced = [x for x in skipped if x.startswith("replaced: ")]
  if replaced:
    lines += ["", "Re-run cases: " + "; ".join(x[len("replaced: "):] for x in replaced) + "."]
  skipped = [x for x in skipped if not x.startswith("replaced: ")]
  if skipped:
    lines += ["", "Skipped: " + "; ".join(skipped)]
  with open(os.path.join(out_dir, "e2e_decode.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines), flush=True)


def main(argv):
  del argv
  t_start = time.perf_counter()
  base = configs.get(FLAGS.config)
  cases = parse_cases(FLAGS.cases)
  if cases:
    variant_names = list(dict.fromkeys(v for v, _, _ in cases))
    contexts = sorted({x for _, x, _ in cases})
    concurrency = sorted({c for _, _, c in cases})
  else:
    variant_names = FLAGS.variants
    contexts = [int(x) for x in FLAGS.contexts]
    concurrency = [int(x) for x in FLAGS.concurrency]
  old = None
  if FLAGS.merge_into:
    with open(FLAGS.merge_into) as f:
      old = json.load(f)  # read once: --out may be the same folder
  layers = min(FLAGS.layers or base.n_layers, base.n_layers)
  config = base.replace(n_layers=layers, max_seq_len=max(base.max_seq_len, max(contexts)))
  on_gpu = jax.default_backend() == "gpu"
  bws = copy_bandwidth((2 << 30) if on_gpu else (64 << 20))
  probe, bw = max(bws.items(), key=lambda kv: kv[1])
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              device=jax.devices()[0].device_kind, jax=jax.__version__, config=base.name, layers=layers,
              full_layers=base.n_layers, steps=FLAGS.steps, copy_bandwidth_tb_s=bw / 1e12, copy_probe=probe,
              copy_probes_tb_s={k: v / 1e12 for k, v in bws.items()}, contexts=contexts, concurrency=concurrency,
              expert_impl=FLAGS.expert_impl, oskvp_impl=FLAGS.oskvp_impl, command=" ".join(sys.argv),
              mgpu_options=FLAGS.mgpu_options,
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75 (default)"))
  print(meta, flush=True)

  def save():
    if old is None:
      runs, merged, skip = [meta], [dict(r, run=0, copy_bandwidth_tb_s=bw / 1e12) for r in rows], skipped
    else:
      runs, merged, skip = merge_runs(old, meta, [dict(r, copy_bandwidth_tb_s=bw / 1e12) for r in rows], skipped)
    write(FLAGS.out, runs, merged, projection(merged, bw), skip)

  rows, skipped = [], []
  models = {}
  variants = []
  for v in variant_names:
    eq, _, kv = v.partition("+")
    try:
      kv_name = kv_mode_name(kv or "bf16")
      if eq not in models:
        models[eq] = build_model(config, eq)
      variants.append((v, eq, kv_name))
    except Exception as e:  # pylint: disable=broad-except
      msg = f"variant {v!r} unavailable: {type(e).__name__}: {e}"
      print(msg, flush=True)
      skipped.append(msg)
  fell_back = {}  # variant -> why it runs on the XLA paths
  kv_layer_bf16 = 2 * config.n_kv_heads * config.head_dim * 2
  counts = param_counts(config)
  for context in contexts:  # the 4k grid of every variant first, so a time-out still leaves a comparison
    for c in concurrency:
      for v, eq, kv in variants:
        if cases and (v, context, c) not in cases:
          continue
        row = dict(variant=v, expert_quant=eq, kv_cache=kv, context=context, concurrency=c, layers=layers,
                   kv_bytes_per_token_per_layer=kv_layer_bf16, params_per_expert=counts["per_expert"])
        if v in fell_back:
          row["fallback"] = fell_back[v]
        if time.perf_counter() - t_start > FLAGS.time_budget_s:
          skipped.append(f"{v} context={context} C={c}: time budget")
          continue
        try:
          try:
            row.update(time_case(models[eq], config, kv, context, c))
          except Exception as e:  # pylint: disable=broad-except
            if "RESOURCE_EXHAUSTED" in str(e) or not uses_pallas(eq, kv):
              raise
            # A Pallas path failed to lower or run: retry this variant on the XLA paths, and say so.
            row["fallback"] = fell_back[v] = f"xla after {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"{v}: Pallas path failed, falling back to XLA: {row['fallback']}", flush=True)
            from moe_jax import quant  # pylint: disable=g-import-not-at-top
            if eq != "bf16":
              quant.set_implementation(models[eq], "xla")
            kv = kv_mode_name(kv.split("_pallas")[0], implementation="xla")
            variants[variants.index((v, eq, row["kv_cache"]))] = (v, eq, kv)
            row["kv_cache"] = kv
            row.update(time_case(models[eq], config, kv, context, c))
          b = step_bytes(config, models[eq], c, row["cache_bytes"])
          row["bytes"] = b
          need = b["other_weights"] + b["experts"] + b["kv"]
          row["roofline_ms"] = need / bw * 1e3
          row["fraction_of_roofline"] = row["roofline_ms"] / row["step_ms"]
          row["full_depth_ms"] = row["head_ms"] + (row["step_ms"] - row["head_ms"]) * base.n_layers / layers
        except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory: record and go on)
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
          row["error_detail"] = str(e)[:4000]
          traceback.print_exc()
        rows.append(row)
        print(f"[{time.perf_counter() - t_start:6.1f} s]", {k: row[k] for k in row if k != "bytes"}, flush=True)
        gc.collect()
        save()
  if FLAGS.full_depth_check and layers < base.n_layers and time.perf_counter() - t_start > FLAGS.time_budget_s - 60:
    meta["full_depth_check"] = dict(variant="bf16+bf16", error="skipped: less than 60 s of the time budget left")
  elif FLAGS.full_depth_check and layers < base.n_layers:
    models.clear()
    gc.collect()
    c, context = max([x for x in concurrency if x <= 32] or [min(concurrency)]), contexts[0]
    fc = dict(variant="bf16+bf16", context=context, concurrency=c)
    ref = next((r for r in rows if r["variant"] == "bf16+bf16" and r["context"] == context
                and r["concurrency"] == c and "step_ms" in r), None)
    if ref is not None:
      fc["scaled_ms"] = ref["full_depth_ms"]
    if True:  # pylint: disable=using-constant-test
      try:
        full = build_model(base.replace(max_seq_len=max(base.max_seq_len, max(contexts))), "bf16")
        fc.update(time_case(full, base, "bf16", context, c))
        del full
      except Exception as e:  # pylint: disable=broad-except
        fc["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        traceback.print_exc()
    meta["full_depth_check"] = fc
  meta["wall_s"] = time.perf_counter() - t_start
  save()
  timed = {(r["variant"], r["context"], r["concurrency"]) for r in rows if "error" not in r}
  if cases and not cases <= timed:
    sys.exit(1)  # a named case failed or did not run (variant unavailable, time budget): let the caller retry it


if __name__ == "__main__":
  app.run(main)
