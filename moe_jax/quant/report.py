"""Quality of quantized experts on a trained checkpoint, through the evaluation harness.

  python -m moe_jax.quant.report --checkpoint=tiny-trained --out=benchmarks/results/expert_quant_quality

For each mode: bits per byte (prefill + teacher-forced decode, `moe_jax.eval.evaluate`) and its relative increase
over the bf16-expert baseline, next-token agreement and KL(baseline || variant), expert bytes (vs the same experts
stored in bf16), bits per weight, and per-expert reconstruction error (relative Frobenius ||W - W_hat|| / ||W|| per
expert, over gate/up/down of every layer) plus the relative output error on calibration activations.
"""

from __future__ import annotations

import json
import os
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax import checkpoints
from moe_jax import eval as eval_lib
from moe_jax.quant.experts import (MODES, collect_expert_inputs, default_calibration_tokens, expert_bytes,
                                   expert_weights, quantize_experts)

DEFAULT_MODES = ("int4", "int4_awq", "int4_sp24", "int4_awq_sp24", "vq2", "vq2_awq", "vq2_sp24")


def output_errors(model, quantized, acts) -> dict[str, float]:
  """Relative output error ||X W - X W_hat|| / ||X W|| of each weight on its calibration inputs."""
  out = {}
  w0, w1 = expert_weights(model), expert_weights(quantized)
  for i, act in enumerate(acts):
    if act is None:
      continue
    for name, key in (("w_gate", "gate_up"), ("w_up", "gate_up"), ("w_down", "down")):
      full = f"blocks.{i}.ffn.{name}"
      x = jnp.asarray(act[key])  # [E, R, K]
      y = jnp.einsum("ERK,EKN->ERN", x, jnp.asarray(w0[full], jnp.float32))
      yq = jnp.einsum("ERK,EKN->ERN", x, w1[full].dequantize(jnp.float32))
      out[full] = float(jnp.linalg.norm(y - yq) / jnp.maximum(jnp.linalg.norm(y), 1e-12))
  return out


def quality(checkpoint: str = "tiny-trained", modes=DEFAULT_MODES, *, n_windows: int = 8, context: int = 256,
            prefix: int = 64) -> dict:
  config, model = checkpoints.load(checkpoint)
  bf16_bytes = sum(int(np.prod(v.shape)) * 2 for v in expert_weights(model).values())
  acts = collect_expert_inputs(model, default_calibration_tokens())
  rows = []
  for mode in modes:
    t0 = time.time()
    q = quantize_experts(nnx.clone(model), mode)
    res = eval_lib.evaluate(model, config, expert_quant=mode, n_windows=n_windows, context=context, prefix=prefix)
    w0, w1 = expert_weights(model), expert_weights(q)
    per_expert = {k: (np.linalg.norm((np.asarray(w1[k].dequantize(jnp.float32)) - np.asarray(w0[k])).reshape(
        w0[k].shape[0], -1), axis=1) / np.linalg.norm(np.asarray(w0[k]).reshape(w0[k].shape[0], -1), axis=1)).tolist()
                  for k in w0}
    flat = np.concatenate([np.asarray(v) for v in per_expert.values()])
    oe = output_errors(model, q, acts)
    rows.append({
        "mode": mode, "bpb": res["bpb"], "baseline_bpb": res["baseline_bpb"],
        "bpb_rel_increase": res["bpb"] / res["baseline_bpb"] - 1.0, "agreement": res["agreement"], "kl": res["kl"],
        "expert_bytes": expert_bytes(q), "expert_bytes_bf16": bf16_bytes,
        "compression_vs_bf16": bf16_bytes / expert_bytes(q),
        "bits_per_weight": 8.0 * expert_bytes(q) / (bf16_bytes / 2),
        "recon_rel_err_mean": float(flat.mean()), "recon_rel_err_max": float(flat.max()),
        "output_rel_err_mean": float(np.mean(list(oe.values()))), "per_expert_recon_rel_err": per_expert,
        "seconds": time.time() - t0,
    })
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_expert_recon_rel_err"}), flush=True)
  return {"checkpoint": checkpoint, "n_windows": n_windows, "context": context, "prefix": prefix,
          "date": time.strftime("%Y-%m-%d"), "rows": rows}


def markdown(result: dict) -> str:
  head = ("| mode | bits/weight | experts vs bf16 | bpb | rel. bpb increase | agreement | KL (nats) | "
          "recon err mean / max | output err |\n|---|---|---|---|---|---|---|---|---|\n")
  lines = [f"| {r['mode']} | {r['bits_per_weight']:.2f} | {r['compression_vs_bf16']:.2f}x smaller | {r['bpb']:.4f} | "
           f"{100 * r['bpb_rel_increase']:+.2f}% | {r['agreement']:.4f} | {r['kl']:.5f} | "
           f"{r['recon_rel_err_mean']:.3f} / {r['recon_rel_err_max']:.3f} | {r['output_rel_err_mean']:.3f} |"
           for r in result["rows"]]
  base = result["rows"][0]["baseline_bpb"] if result["rows"] else float("nan")
  return (f"Checkpoint `{result['checkpoint']}`, {result['n_windows']} validation windows, context "
          f"{result['context']} (prefix {result['prefix']}), baseline (bf16 experts) bpb {base:.4f}, "
          f"{result['date']}.\n\n" + head + "\n".join(lines) + "\n")


def main(argv):
  del argv
  f = flags.FLAGS
  modes = [m for m in f.modes.split(",") if m]
  if not modes:  # an empty report (baseline nan) otherwise
    raise ValueError(f"--modes is empty; choose from {sorted(MODES)}")
  for m in modes:
    if m not in MODES:
      raise ValueError(f"--modes contains {m!r}; choose from {sorted(MODES)}")
  if f.n_windows < 1:  # before: refused only after the model loaded and a mode was quantized
    raise ValueError(f"--n_windows={f.n_windows} must be >= 1")
  try:  # the output's folder first: before, an unusable --out failed after every mode was measured
    os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
  except OSError as e:
    raise ValueError(f"--out={f.out!r}: its folder cannot be created ({e})") from None
  result = quality(f.checkpoint, modes, n_windows=f.n_windows)
  with open(f.out + ".json", "w") as fh:
    json.dump(result, fh, indent=1)
  with open(f.out + ".md", "w") as fh:
    fh.write(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_string("checkpoint", "tiny-trained", "Checkpoint name or directory.")
  flags.DEFINE_string("modes", ",".join(DEFAULT_MODES), "Comma-separated modes of moe_jax.quant.MODES.")
  flags.DEFINE_integer("n_windows", 8, "Validation windows.")
  flags.DEFINE_string("out", "benchmarks/results/expert_quant_quality", "Output path prefix (.md and .json).")
  app.run(main)
