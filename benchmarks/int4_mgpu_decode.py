"""Mosaic GPU int4 grouped matmul at decode shapes, next to the Triton int4 kernel and the bf16 peers, in one run.

  PYTHONPATH=$PWD python3 benchmarks/int4_mgpu_decode.py --out=$OUT

Checks the Mosaic kernel against the XLA reference on the GPU (awkward group sizes, several tile configs), then
times at <= 16 rows per expert with every expert active: XLA `ragged_dot` bf16, jax's Mosaic `ragged_dot_mgpu`
bf16, the Triton int4 kernel (uint16 layout, default tile) and the Mosaic int4 kernel over a few tile configs.
Timing and byte counts as in `expert_matmul.py` (CUPTI kernel time, L2 flushed, median). Writes
`int4_mgpu_decode.json` / `.md` under --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import expert_matmul as em
from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import int4_grouped_matmul_mgpu as mg

SHAPES = [(64, 4096, 2048, [64, 512, 1024]), (128, 2048, 768, [128, 2048]), (8, 4096, 14336, [16, 128])]
# block_n, block_k, max_concurrent_steps, dequant. The second H200 run (results/int4_mgpu_decode_run2.md) also
# timed n64_k256_s6, n128_k256_s4, n128_k512_s2 and n64_k128_s8: all slower than these two.
CONFIGS = {
    "n64_k256_s4_jnp": dict(block_n=64, block_k=256, max_concurrent_steps=4, dequant="jnp"),
    "n64_k256_s4_ptx": dict(block_n=64, block_k=256, max_concurrent_steps=4, dequant="ptx"),
    "n64_k512_s3_ptx": dict(block_n=64, block_k=512, max_concurrent_steps=3, dequant="ptx"),
}


def check(res):
  e, k, n = 6, 512, 256
  for sizes in ([0, 1, 37, 0, 16, 5], [0, 0, 64, 0, 0, 0], [1, 2, 3, 4, 5, 6]):
    gs = jnp.array(sizes, jnp.int32)
    m = int(gs.sum()) + 3  # 3 rows owned by no expert: must come back zero
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    ws = em.random_int4(jax.random.key(2), e, k, n)
    want = np.asarray(i4.int4_grouped_matmul_reference(x, ws, gs))
    w = mg.to_mgpu_layout(ws)
    for name, cfg in [("default", {})] + list(CONFIGS.items()):
      if k % cfg.get("block_k", 128) or n % cfg.get("block_n", 64):
        continue
      tag = f"{sizes}_{name}"
      try:
        got = np.asarray(mg.int4_grouped_matmul_mgpu(x, w, gs, **cfg))
        res[tag] = {"max_rel_err": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
                    "nan": int(np.isnan(got).sum()), "tail_max": float(np.abs(got[-3:]).max())}
      except Exception as ex:  # noqa: BLE001
        res[tag] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
      print(tag, res[tag], flush=True)


def row_recorder(rows_out: list, t0: float):
  """add(impl, rows, e, k, n, ms, fmt, n_active, extra=None): appends a result row (bytes read: the active experts'
  weights in `fmt`, lhs bf16, out f32) to rows_out and prints it."""

  def add(impl, rows, e, k, n, ms, fmt, n_active, extra=None):
    b = n_active * em.weight_bytes(fmt, k, n) + rows * k * 2 + rows * n * 4
    r = {"impl": impl, "rows": rows, "experts": e, "k": k, "n": n, "ms": ms, "bytes_read": b,
         "tb_per_s": b / ms / 1e9, **(extra or {})}
    rows_out.append(r)
    print(json.dumps(r), f"[{time.perf_counter() - t0:.0f} s]", flush=True)
  return add


def decode_weights(e: int, k: int, n: int):
  """Random weights of one shape: (key, bf16 [E, K, N], int4 in the Triton uint16 layout, int4 in the Mosaic layout)."""
  key = jax.random.key(e + k + n)
  w_int4 = em.random_int4(key, e, k, n)
  return key, jax.random.normal(key, (e, k, n), jnp.bfloat16), i4.to_nk_layout(w_int4), mg.to_mgpu_layout(w_int4)


def time_peers(add, timer, key, e, k, n, rows, w_bf16, w_nk, iters, routing="balanced", seed=0, **kernel_kw):
  """At one decode shape (`em.routed_groups(rows, e, routing, seed)`: balanced routing by default): draws x [rows, K]
  bf16 and times the bf16 peers (XLA `ragged_dot`, jax's Mosaic `ragged_dot_mgpu`) and the Triton int4 kernel (uint16
  layout `w_nk`, default tile) through `add`. Returns (x, group_sizes, n_active) for the caller's own kernels."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd  # pylint: disable=g-import-not-at-top
  gs_np = em.routed_groups(rows, e, routing, seed)
  gs, n_active = jnp.asarray(gs_np), int((gs_np > 0).sum())
  x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.bfloat16)
  f = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))
  add("xla_ragged_dot_bf16", rows, e, k, n, timer(f, x, w_bf16, gs, iters=iters), "bf16", n_active)
  try:
    f = jax.jit(functools.partial(rd.ragged_dot, group_sizes=gs, **em.MGPU_BF16_PEER))
    add("mgpu_ragged_dot_bf16", rows, e, k, n, timer(f, x, w_bf16, iters=iters), "bf16", n_active)
  except Exception as ex:  # noqa: BLE001
    print("mgpu bf16 fail", type(ex).__name__, str(ex)[:200], flush=True)
  f = jax.jit(functools.partial(i4.int4_grouped_matmul, **em.CONFIGS["int4_nk"][0], **kernel_kw))
  add("pallas_int4_nk", rows, e, k, n, timer(f, x, w_nk, gs, iters=iters), "int4_nk", n_active)
  return x, gs, n_active


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--iters", type=int, default=10)
  args = ap.parse_args(argv)
  timer, timing = em.kernel_timer()
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "timing": timing,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "group_size": em.G,
          "routing": "balanced", "correctness": {}}
  check(meta["correctness"])
  meta["copy"] = em.copy_bandwidth(timer)
  rows_out, t0 = [], time.perf_counter()

  add = row_recorder(rows_out, t0)

  def save():
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "int4_mgpu_decode.json"), "w") as fh:
      json.dump({**meta, "rows": rows_out}, fh, indent=1)

  for e, k, n, rows_list in SHAPES:
    key, w_bf16, w_nk, w_mg = decode_weights(e, k, n)
    for rows in rows_list:
      x, gs, n_active = time_peers(add, timer, key, e, k, n, rows, w_bf16, w_nk, args.iters)
      for name, cfg in CONFIGS.items():
        if k % cfg["block_k"] or n % cfg["block_n"]:
          continue
        try:
          f = jax.jit(functools.partial(mg.int4_grouped_matmul_mgpu, **cfg))
          add(f"pallas_int4_mgpu[{name}]", rows, e, k, n, timer(f, x, w_mg, gs, iters=args.iters), "int4_mgpu",
              n_active, {"config": cfg})
        except Exception as ex:  # noqa: BLE001
          print("mgpu int4 fail", name, type(ex).__name__, str(ex)[:400], flush=True)
      save()
    del w_bf16, w_nk, w_mg
  save()
  md = em.sweep_markdown({**meta, "rows": rows_out})
  with open(os.path.join(args.out, "int4_mgpu_decode.md"), "w") as fh:
    fh.write(md)
  print(md)
  print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  sys.exit(main())
