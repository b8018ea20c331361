"""decode_step over kv_cache="oskvp_uniform" on the GPU: the Mosaic GPU path inside a jitted model step.

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/oskvp_uniform_decode_check.py
A small random model with head dim 128 (8 query / 2 kv heads, so the core applies: `mosaic_tiling`), ragged prompts
in a 1024-token cache, 12 decode steps (one window flush for the longest prompt) with the cache's implementation
"auto" (the Mosaic core on the GPU) and "xla" (the reference) from the same prefill; prints the largest relative
logit difference per step and the next-token agreement. On the CPU "auto" is the XLA path too (the suite's tests
run the core in its interpreter).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import configs
from moe_jax import decode


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--limit", type=float, default=0.05, help="largest relative logit difference allowed")
  args = ap.parse_args(argv)
  cfg = dataclasses.replace(configs.get("tiny"), d_model=256, n_heads=8, n_kv_heads=2, head_dim=128)
  model = decode.init_model(cfg, seed=0)
  rng = np.random.default_rng(0)
  b, t = 3, 300
  tokens = rng.integers(0, cfg.vocab_size, (b, t + args.steps)).astype(np.int32)
  lengths = np.array([300, 250, 120], np.int32)
  _, cache = decode.prefill(model, tokens[:, :t], lengths, kv_cache="oskvp_uniform", cache_len=1024)
  print("backend", jax.default_backend(), "values_contiguous", cache.layers[0].values_contiguous, flush=True)
  as_impl = lambda c, impl: c.replace(layers=tuple(layer.replace(implementation=impl) for layer in c.layers))
  auto, ref = as_impl(cache, "auto"), as_impl(cache, "xla")
  worst, agree = 0.0, []
  pos = lengths.copy()
  for step in range(args.steps):
    nxt = tokens[np.arange(b), pos]
    la, auto = decode.decode_step(model, auto, jnp.asarray(nxt))
    lr, ref = decode.decode_step(model, ref, jnp.asarray(nxt))
    la, lr = np.asarray(la, np.float32), np.asarray(lr, np.float32)
    rel = float(np.abs(la - lr).max() / np.abs(lr).max())
    worst = max(worst, rel)
    agree.append(float((la.argmax(-1) == lr.argmax(-1)).mean()))
    print(f"step {step}: max |auto - xla| / max |xla| = {rel:.2e}, argmax agreement {agree[-1]:.2f}", flush=True)
    pos += 1
  ok = worst <= args.limit and np.isfinite(worst)
  print(f"{'ok' if ok else 'FAILED'}: worst {worst:.2e} (limit {args.limit}), agreement {np.mean(agree):.3f}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
