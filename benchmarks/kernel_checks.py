"""GPU checks of Triton kernel paths changed on the CPU only, each against its XLA reference, in one short call:

  PYTHONPATH=$PWD python3 benchmarks/kernel_checks.py --out=$OUT/kernel_checks [--interpret]

1. OS-KVP decode attention (`pallas_kernels/oskvp_decode_attention*.py`), head dim 128: more outlier channels than
   a bit plane's H/4 (40, 64, 100: the compact bit-plane form applies the value outliers of every plane they reach)
   and a row with no visible token (zeros, as the reference); the compact bit-plane default with the values in the
   kernel, general and symmetric codebooks, and the mma form.
2. The int4 grouped matmul (`int4_grouped_matmul.py`) with AWQ activation scales, a channel quiet at calibration
   active at inference (x = 300), lhs float16 (the scaled lhs stays float32: it passes 65504) and bfloat16.
3. The int4 grouped matmul with group sizes that are negative or sum past M (offsets count a negative size as 0
   and stop at M): the reference on the sizes so cut.
4. The same group sizes through the Mosaic GPU grouped matmuls (`int4_grouped_matmul_mgpu`, `..._mgpu_ws`,
   `vq2_grouped_matmul_mgpu_ws`) and the work table's Triton kernel (`int4_ws_work_table.work_table`: exact, its
   error column is the largest difference from the reference table).

A case passes when its output is finite and its relative L2 error is under its tolerance (bf16 operands: 1.5e-2;
float16 / float32: 2e-3); an empty row must be exactly 0. Exits 1 if any case fails. Writes <out>.md and <out>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels.oskvp_decode_attention import (BITPLANE, DecodeBlockConfig, _oskvp_pallas,
                                                   oskvp_decode_attention_reference)
from pallas_kernels.oskvp_random import random_oskvp_inputs_host


def rel_l2(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def cut_sizes(sizes, m: int) -> jax.Array:
  """The group sizes the kernels run on: a negative size counts as 0 and the rows stop at M (numpy, independent of
  the kernels' own cut)."""
  return jnp.asarray(np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0))]), m)), jnp.int32)


def oskvp_cases(interpret: bool):
  """Rows of the OS-KVP checks: a batch of 3 with row 1 empty (no compressed token, empty window)."""
  shape = dict(batch=3, heads=8, kv_heads=2, head_dim=128, capacity=300, window=64, n_comp=[300, 0, 37],
               n_res=[5, 0, 64])
  forms = {"bitplane_values_in_kernel": dataclasses.replace(BITPLANE, values_in_kernel=True),
           "mma": DecodeBlockConfig()}
  for outliers in (8, 40, 64, 100):
    for symmetric in (False, True):
      args = random_oskvp_inputs_host(30 + outliers, outliers=outliers, symmetric=symmetric, **shape)
      ref = np.asarray(jax.jit(oskvp_decode_attention_reference)(*args), np.float32)
      for name, config in forms.items():
        out = np.asarray(_oskvp_pallas(*args, interpret=interpret, config=config, poison=True,
                                       symmetric_codebooks=symmetric), np.float32)
        yield dict(check="oskvp", case=f"O={outliers} {'symmetric' if symmetric else 'general'}", form=name,
                   rel_err=rel_l2(out, ref), finite=bool(np.isfinite(out).all()),
                   empty_row_max=float(np.abs(out[1]).max()), tol=1.5e-2)


def int4_awq_cases(interpret: bool):
  """int4 AWQ weights whose channel 10 no calibration row reached, x[:, 10] = 300 at inference."""
  from moe_jax import quant  # pylint: disable=g-import-not-at-top
  e, k, n, m = 2, 256, 128, 16
  w = jax.random.normal(jax.random.key(0), (e, k, n))
  calib = jax.random.normal(jax.random.key(1), (e, 32, k)).at[:, :, :8].multiply(30.0).at[:, :, 10].set(0.0)
  q = quant.quantize_int4(w, calib_x=calib, awq=True)
  gs = jnp.asarray([10, 6], jnp.int32)
  for dtype, tol in ((jnp.float16, 2e-3), (jnp.bfloat16, 1.5e-2)):
    x = jax.random.normal(jax.random.key(2), (m, k)).at[:, 10].set(300.0).astype(dtype)
    ref = np.concatenate([np.asarray(x[:10], np.float64) @ np.asarray(q.dequantize(), np.float64)[0],
                          np.asarray(x[10:], np.float64) @ np.asarray(q.dequantize(), np.float64)[1]])
    out = np.asarray(i4.int4_grouped_matmul(x, q.data, gs, interpret=interpret), np.float32)
    yield dict(check="int4_awq", case=f"lhs {jnp.dtype(dtype).name}, x[:, 10] = 300", form="int4 uint8 layout",
               rel_err=rel_l2(out, ref), finite=bool(np.isfinite(out).all()), tol=tol)


def int4_offset_cases(interpret: bool):
  """Group sizes negative or past M = 8: the reference on the sizes cut at 0 and at M."""
  e, k, n = 4, 256, 64
  ks = jax.random.split(jax.random.key(3), 4)
  ws = i4.Int4Weights(packed=jax.random.bits(ks[0], (e, k // 2, n), jnp.uint8),
                      scale=jax.random.uniform(ks[1], (e, k // 128, n), jnp.float32, 0.01, 0.1),
                      zero=jax.random.randint(ks[2], (e, k // 128, n), 0, 16).astype(jnp.uint8))
  x = jax.random.normal(ks[3], (8, k)).astype(jnp.bfloat16)
  for sizes in ([3, -2, 4, 1], [-2, 6, 0, 2], [3, 0, 4, 9]):
    ref = np.asarray(i4.int4_grouped_matmul_reference(x, ws, cut_sizes(sizes, 8)), np.float32)
    for layout, w in (("uint8", ws), ("nk", i4.to_nk_layout(ws))):
      out = np.asarray(i4.int4_grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), interpret=interpret,
                                              poison=float("nan")), np.float32)
      yield dict(check="int4_offsets", case=f"group_sizes {sizes}", form=f"int4 {layout} layout",
                 rel_err=rel_l2(out, ref), finite=bool(np.isfinite(out).all()), tol=1.5e-2)


def mosaic_grouped_cases(interpret: bool):
  """The Mosaic GPU grouped matmuls (one warpgroup, warp-specialized int4 and vq2) and the work table's Triton
  kernel with group sizes negative or past M: the reference on the sizes cut at 0 and at M."""
  from pallas_kernels import int4_grouped_matmul_mgpu as mg  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_grouped_matmul_mgpu_ws as ws  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_ws_work_table as wt  # pylint: disable=g-import-not-at-top
  from pallas_kernels import vq2_grouped_matmul as v2  # pylint: disable=g-import-not-at-top
  from pallas_kernels import vq2_grouped_matmul_mgpu_ws as vm  # pylint: disable=g-import-not-at-top
  e, k, n = 4, 256, 128
  ks = jax.random.split(jax.random.key(5), 5)
  w4 = i4.Int4Weights(packed=jax.random.bits(ks[0], (e, k // 2, n), jnp.uint8),
                      scale=jax.random.uniform(ks[1], (e, k // 128, n), jnp.float32, 0.01, 0.1).astype(jnp.bfloat16),
                      zero=jax.random.randint(ks[2], (e, k // 128, n), 0, 16).astype(jnp.uint8))
  wv = vm.to_mgpu_layout(v2.VQ2Weights(jax.random.bits(ks[3], (e, k // 4, n), jnp.uint8),
                                       v2.pack_codebook(jax.random.normal(ks[4], (e, 256, 4))),
                                       jnp.full((e, k // 128, n), 0.05, jnp.bfloat16)))
  for sizes, m in (([3, -2, 4, 1], 8), ([20, 20, 0, 0], 24), ([-5, 30, 1, 2], 16)):
    cut = cut_sizes(sizes, m)
    gs = jnp.asarray(sizes, jnp.int32)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
    kw = dict(m=m, m_loaded=max(m + (-m % 8), 16), block_r=8, n_tiles=2, n_experts=e, n_ctas=3)
    table = np.asarray(wt.work_table(gs, **kw, interpret=interpret))
    want_table = np.asarray(wt.work_table_reference(cut, **kw))
    yield dict(check="work_table", case=f"group_sizes {sizes}, M={m}", form="Triton work table",
               rel_err=float(np.abs(table - want_table).max()), finite=True, tol=0.5)  # integer: exact
    runs = {"int4 mgpu": (lambda: mg.int4_grouped_matmul_mgpu(x, mg.to_mgpu_layout(w4), gs, interpret=interpret),
                          lambda: i4.int4_grouped_matmul_reference(x, w4, cut)),
            "int4 mgpu ws": (lambda: ws.int4_grouped_matmul_mgpu_ws(x, ws.to_mgpu_layout(w4), gs,
                                                                     interpret=interpret),
                             lambda: i4.int4_grouped_matmul_reference(x, w4, cut)),
            "vq2 mgpu ws": (lambda: vm.vq2_grouped_matmul_mgpu_ws(x, wv, gs, interpret=interpret),
                            lambda: vm.vq2_grouped_matmul_mgpu_ws_reference(x, wv, cut))}
    for name, (run, ref) in runs.items():
      out, want = np.asarray(run(), np.float32), np.asarray(ref(), np.float32)
      yield dict(check="mosaic_offsets", case=f"group_sizes {sizes}, M={m}", form=name, rel_err=rel_l2(out, want),
                 finite=bool(np.isfinite(out).all()), tol=1.5e-2)


def passed(row) -> bool:
  return row["finite"] and row["rel_err"] < row["tol"] and row.get("empty_row_max", 0.0) == 0.0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/kernel_checks")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU): checks the script only")
  args = ap.parse_args()
  rows = []
  for cases in (oskvp_cases, int4_awq_cases, int4_offset_cases, mosaic_grouped_cases):
    for row in cases(args.interpret):
      row["passed"] = passed(row)
      rows.append(row)
      print(row, flush=True)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  device = jax.devices()[0].device_kind
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(dict(device=device, commit=commit, rows=rows), f, indent=1)
  lines = [f"Kernel checks on {device}, {datetime.date.today()}, jax {jax.__version__}"
           f"{' (interpret mode)' if args.interpret else ''}: {sum(r['passed'] for r in rows)} / {len(rows)} passed.",
           "", "| check | case | form | rel. L2 error | tolerance | finite | empty row max | passed |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['check']} | {r['case']} | {r['form']} | {r['rel_err']:.2e} | {r['tol']:g} | {r['finite']} | "
                 f"{r.get('empty_row_max', '')} | {r['passed']} |")
  lines += ["", f"Provenance: `python3 benchmarks/kernel_checks.py` at {commit} on {device}."]
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
  main()
