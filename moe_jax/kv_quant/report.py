"""KV cache report: memory per mode and preset, attention fidelity, model-level quality.

  python -m moe_jax.kv_quant.report [--quick] [--out_dir=benchmarks/results]

Writes `kv_cache.md`, `kv_cache.json` and `kv_cache_fidelity.png` under out_dir and prints the markdown.
  * Memory: bytes per token per layer of every mode at contexts 1k/8k/32k/128k for the qwen3_30b_a3b and seed_480b
    presets, from `jax.eval_shape` of each mode's real `from_prefill` (one sequence whose prompt fills the context):
    every leaf counted (codes, fp8 outliers, scales, codebooks, U, residual window, counters).
  * Fidelity: attention-output relative error and score KL of what each mode stores (`fidelity.stored_kv`), on
    synthetic post-RoPE keys with planted outlier channels and on the real q/k/v of the shipped `tiny-trained`
    checkpoint (validation text); bits per element measured on the same caches.
  * Model level: `moe_jax.eval.evaluate` (prefill + teacher-forced decode through each cache) on tiny-trained:
    bits per byte vs the bf16 cache and next-token agreement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.kv_cache import KV_CACHE_MODES, get_kv_cache_mode, register_kv_cache_mode
from moe_jax.kv_quant import fidelity, oskvp, static
from moe_jax.kv_quant.oskvp_modes import StaticOSKVPMode

NO_REFIT = "oskvp_no_refit"  # registered by `run` for the short-prompt rows
MODES = ("bf16", "fp8", "int8", "kivi2", "oskvp", "oskvp_sym", "oskvp_uniform", "oskvp3", "oskvp_k3v2",
         "oskvp_k3v2_sym", "oskvp_static")
CONTEXTS = (1024, 8192, 32768, 131072)
PRESETS = ("qwen3_30b_a3b", "seed_480b")
_PARAM_FIELDS = ("u_k", "u_v", "cb_k", "cb_v", "scale_k", "scale_v")


def _abstract_static_mode(kv_heads: int, head_dim: int, bits: int = 2) -> StaticOSKVPMode:
  o = oskvp.n_outliers(head_dim, 0.08)
  p = oskvp.OSKVPParams(u=jnp.zeros((1, kv_heads, head_dim, head_dim)), scale=jnp.zeros((1, kv_heads, o)),
                        codebook=jnp.zeros((1, kv_heads, head_dim, 2**bits)))
  return StaticOSKVPMode(params_k=p, params_v=p)


def layer_cache_bytes(mode_name: str, kv_heads: int, head_dim: int, context: int) -> dict[str, int]:
  """Bytes of one layer's cache for one sequence of `context` tokens, from `jax.eval_shape` of `from_prefill`.

  Returns:
    {"total": all leaves, "params": the per-sequence U/codebook/scale leaves (OS-KVP modes; 0 otherwise)}.
  """
  mode = _abstract_static_mode(kv_heads, head_dim) if mode_name == "oskvp_static" else get_kv_cache_mode(mode_name)
  kv = jax.ShapeDtypeStruct((1, context, kv_heads, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  shapes = jax.eval_shape(lambda k, v, n: mode.from_prefill(k, v, n, context, layer=0), kv, kv, lengths)
  nbytes = lambda x: int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
  total = sum(nbytes(x) for x in jax.tree_util.tree_leaves(shapes))
  params = sum(nbytes(getattr(shapes, f)) for f in _PARAM_FIELDS if hasattr(shapes, f))
  return {"total": total, "params": params}


def memory_table(presets=PRESETS, contexts=CONTEXTS, modes=MODES) -> list[dict]:
  import configs  # pylint: disable=g-import-not-at-top

  rows = []
  for preset in presets:
    c = configs.get(preset)
    for context in contexts:
      base = layer_cache_bytes("bf16", c.n_kv_heads, c.head_dim, context)["total"]
      for mode in modes:
        b = layer_cache_bytes(mode, c.n_kv_heads, c.head_dim, context)
        row = {"preset": preset, "context": context, "mode": mode, "kv_heads": c.n_kv_heads,
               "head_dim": c.head_dim, "layer_bytes": b["total"], "bytes_per_token_per_layer": b["total"] / context,
               "reduction_vs_bf16": 1.0 - b["total"] / base,
               "bits_per_element": 8.0 * b["total"] / (2 * context * c.n_kv_heads * c.head_dim)}
        if mode == "oskvp_static":  # If the calibration were shared by all sequences instead of copied into each.
          row["reduction_vs_bf16_params_shared"] = 1.0 - (b["total"] - b["params"]) / base
        rows.append(row)
  return rows


def synthetic_fidelity(modes, *, tokens: int, n_queries: int, seed: int = 0) -> dict[str, dict[str, float]]:
  q, k, v = fidelity.synthetic_qkv(jax.random.PRNGKey(seed), tokens=tokens)
  q_pos = jnp.arange(tokens - n_queries, tokens)
  return fidelity.mode_fidelity(modes, q[:, -n_queries:], k, v, q_pos)


def _mean_over_layers(per_layer: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
  return {m: {key: float(np.mean([layer[m][key] for layer in per_layer])) for key in per_layer[0][m]}
          for m in per_layer[0]}


def real_fidelity(model, windows: np.ndarray, modes, *, n_queries: int) -> dict:
  """Per-layer fidelity on the captured q/k/v of `windows` (int32 [B, T]), queries at the last n_queries positions."""
  t = windows.shape[1]
  q_pos = jnp.arange(t - n_queries, t)
  per_layer = []
  for layer, (q, k, v) in enumerate(fidelity.capture_qkv(model, windows)):
    per_layer.append(fidelity.mode_fidelity(modes, q[:, -n_queries:], k, v, q_pos, layer=layer))
  return {"mean": _mean_over_layers(per_layer), "per_layer": per_layer}


def calibrate_static(model, train_tokens: np.ndarray, *, n_windows: int, seq_len: int) -> None:
  """Calibrates `oskvp_static` on training-split windows and installs it (orbax round trip included)."""
  import tempfile  # pylint: disable=g-import-not-at-top

  mode = static.calibrate_on_training_split(model, n_windows=n_windows, seq_len=seq_len, tokens=train_tokens)
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "oskvp_static")
    static.save(path, mode)
    static.install(static.load(path))


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  panels = [("synthetic", "synthetic keys, planted outliers"), ("real", "tiny-trained q/k/v (mean over layers)")]
  panels = [(k, t) for k, t in panels if k in results]
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
  for ax, (key, title) in zip(axes[0], panels):
    data = results[key]["mean"] if "mean" in results[key] else results[key]["modes"]
    for i, (mode, d) in enumerate(data.items()):
      if mode == "bf16":
        continue
      color = f"C{i}"
      ax.scatter(d["bits_per_element"], d["rel_err"], s=40, color=color)
      ax.annotate(mode, (d["bits_per_element"], d["rel_err"]), textcoords="offset points", xytext=(4, 4))
      if "asymptotic_bits" in d and abs(d["asymptotic_bits"] - d["bits_per_element"]) > 0.05:
        ax.scatter(d["asymptotic_bits"], d["rel_err"], s=40, marker="x", color=color)
        ax.plot([d["bits_per_element"], d["asymptotic_bits"]], [d["rel_err"]] * 2, ls=":", color=color)
        ax.annotate(f"{mode} @32k", (d["asymptotic_bits"], d["rel_err"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=8, color=color)
    ax.set_yscale("log")
    ax.set_xlabel("bits per stored element (o: measured cache; x: same layout at 32k tokens)")
    ax.set_ylabel("attention output relative error")
    ax.set_title(title)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def markdown(results: dict) -> str:
  lines = [f"# KV cache modes: memory and fidelity\n",
           f"{results['date']} · {results['device']} · jax {results['jax']} · `python -m moe_jax.kv_quant.report"
           f"{' --quick' if results['quick'] else ''}`\n"]
  lines.append("## Memory: bytes per token per layer (one sequence, cache_len = context, every leaf counted)\n")
  mem = results["memory"]
  for preset in dict.fromkeys(r["preset"] for r in mem):
    rows = [r for r in mem if r["preset"] == preset]
    ctxs = list(dict.fromkeys(r["context"] for r in rows))
    lines.append(f"**{preset}** (K={rows[0]['kv_heads']} kv heads, H={rows[0]['head_dim']})\n")
    lines.append("| mode | " + " | ".join(f"{c // 1024}k: B/tok/layer (reduction)" for c in ctxs) + " |")
    lines.append("|---|" + "---|" * len(ctxs))
    for mode in dict.fromkeys(r["mode"] for r in rows):
      cells = []
      for c in ctxs:
        r = next(x for x in rows if x["mode"] == mode and x["context"] == c)
        cell = f"{r['bytes_per_token_per_layer']:.1f} ({100 * r['reduction_vs_bf16']:.1f}%)"
        if "reduction_vs_bf16_params_shared" in r:
          cell += f" [shared params: {100 * r['reduction_vs_bf16_params_shared']:.1f}%]"
        cells.append(cell)
      lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines.append("")
  for key, title in (("synthetic", "Fidelity, synthetic post-RoPE keys with planted outlier channels"),
                     ("real", "Fidelity, real q/k/v captured from tiny-trained (mean over layers)")):
    if key not in results:
      continue
    res = results[key]
    lines.append(f"## {title}\n\n{res['setup']}\n")
    lines.append("| mode | bits/element (measured) | bits/element at 32k | attention out rel. err | score KL (nats) "
                 "| key rel. err | value rel. err |")
    lines.append("|---|---|---|---|---|---|---|")
    data = res["mean"] if "mean" in res else res["modes"]
    for mode, d in data.items():
      lines.append(f"| {mode} | {d['bits_per_element']:.2f} | {d.get('asymptotic_bits', float('nan')):.2f} | "
                   f"{d['rel_err']:.4f} | {d['kl']:.2e} | {d['key_rel_err']:.4f} | {d['value_rel_err']:.4f} |")
    lines.append("")
  if "model_level" in results:
    ml = results["model_level"]
    lines.append(f"## Model level: tiny-trained through prefill + teacher-forced decode (`moe_jax.eval`)\n\n"
                 f"{ml['setup']}\n")
    lines.append("| kv_cache | bpb | bf16-cache bpb | bpb increase | next-token agreement | KL (nats) | cache bytes |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in ml["rows"]:
      lines.append(f"| {r['kv_cache']} | {r['bpb']:.4f} | {r['baseline_bpb']:.4f} | "
                   f"{100 * (r['bpb'] / r['baseline_bpb'] - 1):+.2f}% | {r['agreement']:.4f} | {r['kl']:.2e} | "
                   f"{r['kv_cache_bytes']:,} |")
    lines.append("")
  if "short_prompts" in results:
    sp = results["short_prompts"]
    lines.append(f"## Short prompts: refit at the first flush\n\n{sp['setup']}\n")
    lines.append("| kv_cache | prompt | bpb increase | next-token agreement | KL (nats) |")
    lines.append("|---|---|---|---|---|")
    for r in sp["rows"]:
      lines.append(f"| {r['kv_cache']} | {r['prefix']} | {100 * (r['bpb'] / r['baseline_bpb'] - 1):+.2f}% | "
                   f"{r['agreement']:.4f} | {r['kl']:.2e} |")
    lines.append("")
  if results.get("verdicts"):
    lines.append("## Verdicts\n")
    lines.extend(f"- {v}" for v in results["verdicts"])
  return "\n".join(lines) + "\n"


def _asymptotic_bits(head_dim: int) -> dict[str, float]:
  """Bits per element of each mode at 32k context for a preset-like shape with this head_dim (K = 1)."""
  return {m: 8.0 * layer_cache_bytes(m, 1, head_dim, 32768)["total"] / (2 * 32768 * head_dim) for m in MODES}


def verdicts(results: dict) -> list[str]:
  out = []
  for r in results["memory"]:
    if r["mode"] == "oskvp" and r["context"] == 32768:
      ok = r["reduction_vs_bf16"] >= 0.80
      out.append(f"{r['preset']}: oskvp is {100 * r['reduction_vs_bf16']:.1f}% smaller than bf16 at 32k "
                 f"(goal >= 80%: {'holds' if ok else 'MISSED'}).")
  for key in ("synthetic", "real"):
    if key not in results:
      continue
    d = results[key]["mean"] if "mean" in results[key] else results[key]["modes"]
    if "oskvp" in d and "kivi2" in d:
      o, k = d["oskvp"], d["kivi2"]
      fewer_now = o["bits_per_element"] <= k["bits_per_element"]
      fewer_32k = o["asymptotic_bits"] <= k["asymptotic_bits"]
      better = o["rel_err"] < k["rel_err"]
      out.append(f"{key}: oskvp attention error {o['rel_err']:.4f} vs kivi2 {k['rel_err']:.4f} "
                 f"({'lower' if better else 'HIGHER'}); bits/element {o['bits_per_element']:.2f} vs "
                 f"{k['bits_per_element']:.2f} at the measured length ({'fewer/equal' if fewer_now else 'MORE'}), "
                 f"{o['asymptotic_bits']:.2f} vs {k['asymptotic_bits']:.2f} at 32k "
                 f"({'fewer/equal' if fewer_32k else 'MORE'}).")
  if "model_level" in results:
    for r in results["model_level"]["rows"]:
      if r["kv_cache"].startswith("oskvp"):
        inc = r["bpb"] / r["baseline_bpb"] - 1
        out.append(f"model level, {r['kv_cache']}: bits per byte {100 * inc:+.2f}% vs the bf16 cache "
                   f"(goal <= +1%: {'holds' if inc <= 0.01 else 'MISSED'}), agreement {r['agreement']:.4f}.")
  return out


def run(*, quick: bool = False, out_dir: str = "benchmarks/results", model_level: bool = True) -> dict:
  from moe_jax import checkpoints, data as data_lib, eval as eval_lib  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)  # an unusable out_dir fails now, not after the whole run
  t0 = time.time()
  results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jax": jax.__version__, "quick": quick,
             "device": f"CPU ({platform.processor() or platform.machine()}), {jax.devices()[0].platform}"}
  results["memory"] = memory_table()

  syn_tokens, syn_queries = (1024, 64) if quick else (4096, 128)
  syn_modes = [m for m in MODES if m != "oskvp_static"]
  syn = synthetic_fidelity(syn_modes, tokens=syn_tokens, n_queries=syn_queries)
  for m, bits in _asymptotic_bits(128).items():
    if m in syn:
      syn[m]["asymptotic_bits"] = bits
  results["synthetic"] = {"modes": syn, "setup": (
      f"B=2 sequences x {syn_tokens} tokens, K=2 kv heads, G=2, H=128, 3 outlier RoPE channel pairs per head "
      f"(std 8, mean 4; other channels N(0,1)), RoPE theta 1e4; the last {syn_queries} positions query causally. "
      "Each mode stores the whole sequence with cache_len = length (the residual window holds the last 128 tokens).")}

  config, model = checkpoints.load("tiny-trained")
  corpus = data_lib.load_corpus()
  n_win, seq = (2, 512) if quick else (4, 1024)
  calibrate_static(model, corpus["train"].tokens, n_windows=4 if quick else 16, seq_len=seq)
  windows = data_lib.eval_windows(corpus["validation"].tokens, n_windows=n_win, seq_len=seq - 1)
  real = real_fidelity(model, windows, MODES, n_queries=128 if quick else 256)
  for m, bits in _asymptotic_bits(config.head_dim).items():
    real["mean"][m]["asymptotic_bits"] = bits
  real["setup"] = (f"tiny-trained (H={config.head_dim}, K={config.n_kv_heads}, {config.n_layers} layers), "
                   f"{n_win} validation windows x {seq} tokens; the last {128 if quick else 256} positions query "
                   "causally. oskvp_static is calibrated on training-split windows (saved and reloaded with orbax).")
  results["real"] = real

  if model_level:
    # 16 windows: at 4 (this report before 2026-12-05) oskvp read +0.41%; over these 16, +1.85%
    n_eval, context, prefix = (2, 256, 128) if quick else (16, 512, 256)
    rows = []
    for mode in MODES[1:]:
      rows.append(eval_lib.evaluate(model, config, kv_cache=mode, n_windows=n_eval, context=context, prefix=prefix))
    results["model_level"] = {"rows": rows, "setup": (
        f"{n_eval} validation windows, prefix {prefix} tokens prefilled (compressed modes compress all but the "
        f"window), then {context - prefix} teacher-forced decode steps (window flushes included); "
        f"{rows[0]['scored_tokens']} scored predictions per mode.")}
    # Prompts shorter than the window, with and without the refit at the first flush
    if NO_REFIT not in KV_CACHE_MODES:
      register_kv_cache_mode(NO_REFIT, dataclasses.replace(get_kv_cache_mode("oskvp"), refit_at_first_flush=False))
    short, prompts = [], (2,) if quick else (2, 16, 64)
    for p in prompts:
      for mode in ("oskvp", NO_REFIT):
        short.append(eval_lib.evaluate(model, config, kv_cache=mode, n_windows=n_eval, context=context, prefix=p))
    results["short_prompts"] = {"rows": short, "setup": (
        f"{n_eval} validation windows of {context} tokens, prompts of {', '.join(str(p) for p in prompts)} "
        f"tokens prefilled, the rest teacher-forced; `{NO_REFIT}` is oskvp with "
        "`OSKVPMode(refit_at_first_flush=False)`.")}

  results["verdicts"] = verdicts(results)
  results["seconds"] = time.time() - t0
  plot(results, os.path.join(out_dir, "kv_cache_fidelity.png"))
  with open(os.path.join(out_dir, "kv_cache.json"), "w") as f:
    json.dump(results, f, indent=1, default=float)
  with open(os.path.join(out_dir, "kv_cache.md"), "w") as f:
    f.write(markdown(results))
  return results


def main(argv):
  del argv
  f = flags.FLAGS
  print(markdown(run(quick=f.quick, out_dir=f.out_dir, model_level=f.model_level)))


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_bool("quick", False, "Small sizes (CI smoke run).")
  flags.DEFINE_string("out_dir", "benchmarks/results", "Where kv_cache.{md,json,png} go.")
  flags.DEFINE_bool("model_level", True, "Run the model-level evaluation (slowest part).")
  app.run(main)
