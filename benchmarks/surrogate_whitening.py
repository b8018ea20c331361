"""Surrogate whitening on `tiny-trained` (CPU, ~30 s): every remote pair of 2 nodes (λ = 0) served by rank-16 / 64
surrogates, plain SVD against activation-whitened (16 calibration windows), with the quality harness of
`sharding.experiments` (8 validation windows, prefill 32 + teacher-forced decode to 128).

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv/bin/python benchmarks/surrogate_whitening.py \\
        --out=benchmarks/results/sharding/cpu8/surrogate_whitening.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax

from moe_jax import locality
from sharding import experiments as ex


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--ranks", default="16,64")
  args = ap.parse_args(argv)
  jax.config.update("jax_default_matmul_precision", "highest")
  config, model, _ = ex.load_model("tiny-trained")
  windows, calib = ex.token_data(config, n_windows=8, context=128, n_calib=4, calib_len=128)
  quality = ex.Quality(model, windows, 32)
  rows = []
  for rank in (int(r) for r in args.ranks.split(",")):
    for whiten in (False, True):
      m = ex.lcvc_model(model, 2, penalty=0.0, rank=rank, target=0.1, calib=calib, whiten=whiten, tune_rounds=0)
      locality.set_penalty(m, 0.0, threshold=0.5)
      rows.append({"rank": rank, "whitened": whiten, "remote_rate": ex.remote_rate(m, windows), **quality(m)})
      print(json.dumps(rows[-1]), flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
