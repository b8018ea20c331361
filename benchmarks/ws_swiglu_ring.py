"""The fused gate/up + SwiGLU call's TMA ring: with its h buffer counted against the ring's shared-memory budget
(before the eighteenth session) 32-row tiles at K = 2048 got 2 stages instead of the single call's 4.

    PYTHONPATH=$PWD python3 benchmarks/ws_swiglu_ring.py --out=$OUT     # H200, ~1 min

Per shape and row count (balanced routing): the fused call with its default ring, the same with
`max_concurrent_steps=2` (the ring it had before at 2048→768 with 32-row tiles), two single calls plus XLA's
silu · up, and one single call; CUPTI, L2 flushed (`expert_matmul.kernel_timer`). The fused result is checked against
each weight's float32 dequantization. Writes ws_swiglu_ring.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import expert_matmul as em  # noqa: E402
from pallas_kernels import int4_gate_up_mgpu as gu  # noqa: E402
from pallas_kernels import int4_grouped_matmul_mgpu_ws as mws  # noqa: E402

CASES = ((128, 2048, 768, (2496, 4096)), (64, 4096, 2048, (2048,)), (128, 2048, 768, (2048,)))


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--iters", type=int, default=15)
  args = ap.parse_args(argv)
  timer, timing = em.kernel_timer()
  fused = jax.jit(functools.partial(mws.int4_grouped_matmul_mgpu_ws, swiglu=True))
  fused_ring2 = jax.jit(functools.partial(mws.int4_grouped_matmul_mgpu_ws, swiglu=True, max_concurrent_steps=2))
  one = jax.jit(mws.int4_grouped_matmul_mgpu_ws)
  two = jax.jit(lambda x, wg, wu, gs: jax.nn.silu(one(x, wg, gs)) * one(x, wu, gs))
  rows_out = []
  for e, k, n, rows_list in CASES:
    key = jax.random.key(e + k + n)
    wg = mws.to_mgpu_layout(em.random_int4(key, e, k, n))
    wu = mws.to_mgpu_layout(em.random_int4(jax.random.fold_in(key, 1), e, k, n))  # two weights: no CSE
    wgu = gu.interleave_gate_up(wg, wu)
    for rows in rows_list:
      gs = jnp.asarray(em.balanced_groups(rows, e))
      x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.bfloat16)
      ref = lambda w: mws.int4_grouped_matmul_mgpu_ws_form_reference(x, w, gs, "acc_scale")  # noqa: B023
      want, got = np.asarray(jax.nn.silu(ref(wg)) * ref(wu)), np.asarray(fused(x, wgu, gs))
      r = {"e": e, "k": k, "n": n, "rows": rows, "err": float(np.abs(got - want).max() / np.abs(want).max()),
           "nan": int(np.isnan(got).sum()), "fused": timer(fused, x, wgu, gs, iters=args.iters),
           "fused_ring2": timer(fused_ring2, x, wgu, gs, iters=args.iters),
           "two_calls": timer(two, x, wg, wu, gs, iters=args.iters),
           "one_call": timer(one, x, wg, gs, iters=args.iters)}
      print(r, flush=True)
      rows_out.append(r)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "ws_swiglu_ring.json"), "w") as fh:
    json.dump({"device": jax.devices()[0].device_kind, "timing": timing, "rows": rows_out}, fh, indent=1)


if __name__ == "__main__":
  main()
