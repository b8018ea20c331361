"""Converts a bf16/f32 checkpoint's routed experts to int4 / vq2 (optionally 2:4-sparse) and saves it with orbax.

  python -m moe_jax.quant.convert --checkpoint=tiny-trained --expert_quant=int4|int4_awq|vq2 [--sparsity=2:4] \\
      --out=DIR

Calibration (AWQ, 2:4 saliency) uses windows of the training split. Prints expert bytes before and after and the
per-weight reconstruction error; `moe_jax.quant.load_quantized(DIR)` reads the result back.
"""

from __future__ import annotations

import json

import numpy as np

from moe_jax import checkpoints
from moe_jax.quant.experts import expert_bytes, expert_weights, quantize_experts, spec_for
from moe_jax.quant.formats import QuantizedExperts
from moe_jax.quant.io import check_out_dir, save_quantized


def reconstruction_errors(original: dict, quantized: dict) -> dict[str, list[float]]:
  """Per weight name, per expert relative Frobenius error ||W - W_hat|| / ||W||."""
  out = {}
  for name, w in original.items():
    q = quantized[name]
    w_hat = q.dequantize(np.float32) if isinstance(q, QuantizedExperts) else q
    w = np.asarray(w, np.float32)
    diff = np.asarray(w_hat, np.float32) - w
    out[name] = (np.linalg.norm(diff.reshape(w.shape[0], -1), axis=1)
                 / np.maximum(np.linalg.norm(w.reshape(w.shape[0], -1), axis=1), 1e-12)).tolist()
  return out


def convert(checkpoint: str, expert_quant: str, out: str, *, sparsity: str | None = None) -> dict:
  """Quantizes `checkpoint`'s experts by `expert_quant` (+ `sparsity`: "2:4", None for the mode's own, "none" for
  dense) into `out`; returns the sizes, the mean reconstruction error and the sparsity used."""
  spec = spec_for(expert_quant, None if sparsity == "none" else sparsity)
  if sparsity == "none" and spec.sparsity:  # before: ignored, the output 2:4-sparse and reported as dense
    raise ValueError(f"sparsity='none' with expert_quant={expert_quant!r}, a {spec.sparsity}-sparse mode: choose a "
                     "dense mode instead")
  check_out_dir(out)  # before the model loads and quantizes
  config, model = checkpoints.load(checkpoint)
  before = expert_bytes(model)
  original = {k: np.asarray(v) for k, v in expert_weights(model).items()}
  quantize_experts(model, spec)
  errors = reconstruction_errors(original, expert_weights(model))
  save_quantized(model, config, spec, out, source=checkpoint)
  return {"out": out, "expert_quant": expert_quant, "sparsity": spec.sparsity, "expert_bytes_before": before,
          "expert_bytes_after": expert_bytes(model), "mean_rel_error": float(np.mean([np.mean(v) for v in
                                                                                     errors.values()]))}


def main(argv):
  del argv
  f = flags.FLAGS
  print(json.dumps(convert(f.checkpoint, f.expert_quant, f.out, sparsity=f.sparsity or None), indent=2))


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_string("checkpoint", "tiny-trained", "Shipped checkpoint name or directory (config.json + safetensors).")
  flags.DEFINE_string("expert_quant", "int4", "int4 | int4_awq | vq2 | vq2_awq (or a full mode name such as "
                      "int4_sp24).")
  flags.DEFINE_string("sparsity", "", "'2:4' adds micro-sparsity to the mode; empty keeps the mode's own (dense, "
                      "except the *_sp24 modes).")
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  app.run(main)
