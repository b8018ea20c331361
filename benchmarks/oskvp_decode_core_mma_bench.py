"""The warp-level (mma.sync) OS-KVP core against the wgmma core, side by side on one GPU.

Run on the GPU:  PYTHONPATH=$PWD python3 benchmarks/oskvp_decode_core_mma_bench.py --out=$OUT
CPU smoke test:  PYTHONPATH=$PWD python3 benchmarks/oskvp_decode_core_mma_bench.py --smoke --out=/tmp/mma_smoke
                 (the numpy model of the GPU route, `oskvp_decode_core_mma_model.emulate`, stands in for the
                 kernel: checks only)

1. Checks, both key orientations: `decode_core_mma` against its blockwise XLA model (`decode_core_mma_reference`):
   each output's max abs error over the heads in use, divided by max(1, max |model output|) (the code outputs lie in
   [0, 3], the value-outlier sums in the fp8 values' range), within 1e-3; codes only and with fp8 outliers and
   ragged lengths, G = 4 and 8. The same errors against the exact softmax for the record, next to the wgmma core's.
2. Timing (CUPTI, L2 flushed, median of --iters) at BK = 64 (batch 8 × 8 kv heads), 16 splits and ring 2 unless a
   row says otherwise: the kernel alone and the call (kernel + XLA merge) of both cores, with outliers and lengths
   (the wired form) and on codes alone, and both cores' compute side alone (`l2_resident`) and the mma core's memory
   side alone (`no_compute`).
3. Writes oskvp_decode_core_mma.{md,json} under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import oskvp_decode_core_mgpu_bench as cb
from benchmarks import oskvp_key_scores_mgpu_bench as kb
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_decode_core_mma as dm
from pallas_kernels import oskvp_decode_core_mma_model as dmm

BK = 64
# BK, S, splits, lengths (None: all), outliers, G
CHECKS = [(2, 1024, 2, None, False, 4), (3, 2048, 4, None, False, 8), (4, 4096, 2, (1, 127, 1000, 4096), True, 4),
          (2, 8192, 4, (300, 8192), True, 8), (2, 4096, 1, (0, 4095), True, 4)]
SMOKE_CHECKS = [(1, 256, 2, None, False, 4), (2, 256, 1, (1, 200), True, 8)]
# S, kernel (mma / mgpu), variant: "wired" (outliers + lengths), "codes", or an ablation of the mma core, "+heads" /
# "+tokens" its key rows (16 splits, ring 2; `--timed` sets others)
TIMED = [(65536, "mma", "wired"), (65536, "mma", "wired+heads"), (65536, "mgpu", "wired"), (65536, "mma", "codes"),
         (65536, "mma", "codes+heads"), (65536, "mgpu", "codes"), (65536, "mma", "no_compute"),
         (65536, "mgpu", "no_compute"), (65536, "mma", "l2_resident"), (65536, "mma", "l2_resident+heads"),
         (65536, "mgpu", "l2_resident"), (16384, "mma", "wired"), (16384, "mgpu", "wired"), (131072, "mma", "wired"),
         (131072, "mgpu", "wired")]


def case_args(bk: int, s: int, lengths, outliers: bool, g: int, seed: int):
  """A check's inputs: random codes, G query heads' digits, lengths (or None), fp8 outliers (or none)."""
  kc, vc, qd, qs = cb.inputs(seed, bk, s, g)
  lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  extra = cb.outlier_inputs(seed + 1, bk, s, g) if outliers else ()
  return (kc, vc, qd, qs, lengths, *extra)


def run_check(case, smoke: bool, key_rows: str = dm.KEY_ROW_DEFAULT) -> dict:
  """One check (the kernel, or on the CPU its numpy model `emulate`) against the XLA model: a report row."""
  bk, s, splits, lengths, outliers, g = case
  args = case_args(bk, s, lengths, outliers, g, bk * s + splits)
  row = dict(bk=bk, s=s, splits=splits, lengths=lengths, outliers=outliers, g=g, key_rows=key_rows)
  as_tuple = lambda x: x if isinstance(x, tuple) else (x,)
  try:
    got = as_tuple(dmm.emulate(*args, splits=splits, key_rows=key_rows) if smoke else
                   dm.decode_core_mma(*args, splits=splits, key_rows=key_rows))
  except Exception as e:  # pylint: disable=broad-except
    return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
  model = as_tuple(dm.decode_core_mma_reference(*args, splits=splits))
  exact = as_tuple(dc.decode_core_reference(*args))
  wgmma = None if smoke else as_tuple(dc.decode_core_mgpu(*args, block_s=128, splits=splits, max_concurrent_steps=2,
                                                          value_outliers="fp8_stacked"))
  # per output (codes; value outliers): max abs error over the heads in use / max(1, max |reference|)
  def err(a, b):
    return [float(np.abs(np.asarray(x)[:, :g] - np.asarray(y)[:, :g]).max()
                  / max(1.0, float(np.abs(np.asarray(y)[:, :g]).max()))) for x, y in zip(a, b)]

  finite = all(np.isfinite(np.asarray(x)).all() for x in got)
  res = {**row, "ok": bool(max(err(got, model)) <= 1e-3 and finite), "rel_err_vs_model": err(got, model),
         "rel_err_vs_exact_softmax": err(got, exact), "model_vs_exact": err(model, exact)}
  if wgmma is not None:
    res["wgmma_core_vs_exact_softmax"] = err(wgmma, exact)
  return res


VARIANTS = ("wired", "codes", "no_compute", "l2_resident")  # the ablations time the wired form


def parse_variant(kernel: str, variant: str) -> tuple[str, str]:
  """"base[+heads|+tokens]" -> (base, key_rows); ValueError naming the field for anything else."""
  base, _, suffix = variant.partition("+")
  if kernel not in ("mma", "mgpu"):
    raise ValueError(f"kernel={kernel!r} must be 'mma' or 'mgpu'")
  if base not in VARIANTS or (suffix and (kernel != "mma" or suffix not in dm.KEY_ROWS)):
    raise ValueError(f"variant={variant!r} must be one of {VARIANTS}, with '+heads' / '+tokens' for the mma core")
  return base, suffix or dm.KEY_ROW_DEFAULT


def timed_fn(kernel: str, variant: str, splits: int = 16, ring: int = 2):
  """The timed call: variant "wired", "codes" or an ablation ("no_compute", "l2_resident"; either core), "+tokens" /
  "+heads" the mma core's key rows (else its default)."""
  base, key_rows = parse_variant(kernel, variant)
  ablate = base if base in dm.ABLATIONS else ""
  if kernel == "mma":
    return jax.jit(lambda *a: dm.decode_core_mma(*a, splits=splits, max_concurrent_steps=ring, ablate=ablate,
                                                 key_rows=key_rows))
  return jax.jit(lambda *a: dc.decode_core_mgpu(*a, block_s=128, splits=splits, max_concurrent_steps=ring,
                                                value_outliers="fp8_stacked", ablate=ablate))


def timed_args(s: int, variant: str):
  """BK = 64 rows of S tokens: codes alone for "codes", else with full lengths and fp8 outliers."""
  kc, vc, qd, qs = cb.inputs(0, BK, s)
  if variant.split("+")[0] == "codes":
    return kc, vc, qd, qs
  return (kc, vc, qd, qs, jnp.full((BK,), s, jnp.int32), *cb.outlier_inputs(1, BK, s))


def write_report(out_dir: str, meta: dict, checks: list, rows: list) -> None:
  """oskvp_decode_core_mma.{json,md} under out_dir."""
  with open(os.path.join(out_dir, "oskvp_decode_core_mma.json"), "w") as fh:
    json.dump(dict(meta=meta, checks=checks, rows=rows), fh, indent=1)
  lines = [f"# Warp-level (mma.sync) OS-KVP core vs the wgmma core: {meta.get('device')}, jax {meta.get('jax')}, "
           f"{meta.get('date')}", "",
           ("CPU smoke run: the numpy model's checks only." if str(meta.get("mode", "")).startswith("smoke") else
            "CUPTI kernel time, median of the calls, L2 flushed. BK = 64 (batch 8 × 8 kv heads), H = 128, G = 4. "
            "`wired`: fp8 outliers and lengths (every row full), the form `decode_step` runs; `codes`: the codes "
            "alone; "
            "`no_compute` / `l2_resident`: the wired form's memory / compute side alone (their TB/s is nominal). "
            "`+heads` / `+tokens`: the mma core's key rows (unsuffixed: its default, "
            f"{dm.KEY_ROW_DEFAULT!r}). `kernel µs`: the core kernel alone; `call µs`: with the XLA merge of the "
            "splits."), "", "## Checks", ""]
  for c in checks:
    lines.append(f"- {'ok' if c.get('ok') else 'FAILED'} {json.dumps(c)}")
  lines += ["", "## Timing", "", "| S | core | variant | splits | ring | kernel µs | call µs | TB/s (kernel) |",
            "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    head = f"| {r['s']} | {r['kernel']} | {r['variant']} | {r.get('splits', 16)} | {r.get('ring', 2)} |"
    if "error" in r:
      lines.append(f"{head} error: {r['error'][:200]} | | |")
    else:
      lines.append(f"{head} {r['kernel_us']:.1f} | {r['call_us']:.1f} | {r['tb_per_s']:.2f} |")
  with open(os.path.join(out_dir, "oskvp_decode_core_mma.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")


SASS_KINDS = {"all": ".", "IMMA": r"\bIMMA", "HMMA": r"\bHMMA", "MOVM": "MOVM", "LDS": r"\bLDS", "STS": r"\bSTS",
              "LOP3": "LOP3", "SHF/SHL/SHR": r"\bSH[FLR]", "PRMT": "PRMT", "IMAD/IADD/LEA": r"IMAD|IADD|\bLEA",
              "I2F/F2I/F2F/FRND": r"I2F|F2I|F2F|FRND", "MUFU": "MUFU", "FFMA/FMUL/FADD/HADD2": r"FFMA|FMUL|FADD|HADD2",
              "FMNMX": "FMNMX", "SHFL": "SHFL", "VOTE": "VOTE", "IDP": "IDP", "SETP/SEL": r"SETP|SEL\b|FSEL",
              "SYNCS/BAR": "SYNCS|BAR", "BRA": "BRA", "MOV": r"\bMOV\b|\bMOV\."}


def analyze_dump(path: str, ptxas: str = "ptxas", nvdisasm: str | None = None) -> dict:
  """Without a GPU: each `*.ptx` of a MOSAIC_GPU_DUMP_TO folder compiled here, its ptxas report and the loops that
  hold a warp-level mma (IMMA / HMMA), longest first, with their instructions by kind
  (`triton_sass.analyze_ptx_dump`): one trip of the pipeline loop is one 128-token step, 32 tokens for each warp."""
  from benchmarks import triton_sass  # pylint: disable=g-import-not-at-top
  return triton_sass.analyze_ptx_dump(path, SASS_KINDS, marker=r"\b[IH]MMA", ptxas=ptxas, nvdisasm=nvdisasm)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/oskvp_decode_core_mma")
  ap.add_argument("--smoke", action="store_true", help="CPU: the numpy model against the XLA model; no timing")
  ap.add_argument("--iters", type=int, default=7)
  ap.add_argument("--checks", default="all", choices=("all", "none"))
  ap.add_argument("--timed", default="", help="S:kernel:variant[:splits[:ring]] rows instead of TIMED, "
                  "comma-separated (splits 16, ring 2 by default)")
  ap.add_argument("--analyze_dump", default="", help="MOSAIC_GPU_DUMP_TO folders (comma-separated), read here "
                  "without a GPU: ptxas report and the mma loops' SASS by kind (`analyze_dump`); nothing else runs")
  args = ap.parse_args(argv)
  if args.analyze_dump:
    print(json.dumps({d: analyze_dump(d) for d in args.analyze_dump.split(",")}, indent=1))
    return 0
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  meta = kb.run_meta(args.smoke, args.iters)
  checks, rows = [], []
  orientations = dm.KEY_ROWS
  for case, key_rows in [(c, k) for c in (SMOKE_CHECKS if args.smoke else CHECKS) for k in orientations] \
      if args.checks == "all" else ():
    checks.append(run_check(case, args.smoke, key_rows))
    print("check", json.dumps(checks[-1]), flush=True)
    write_report(args.out, meta, checks, rows)
  if not all(c["ok"] for c in checks):
    print("CHECK FAILED", flush=True)
    return 1
  timed = [(*row, 16, 2) for row in TIMED]
  if args.timed:
    timed = [(int(f[0]), f[1], f[2], int(f[3]) if len(f) > 3 else 16, int(f[4]) if len(f) > 4 else 2)
             for f in (t.split(":") for t in args.timed.split(","))]
  for _, kernel, variant, _, _ in timed:
    try:
      parse_variant(kernel, variant)
    except ValueError as e:
      ap.error(f"--timed: {e}")
  for s, kernel, variant, splits, ring in () if args.smoke else timed:
    row = dict(s=s, kernel=kernel, variant=variant, splits=splits, ring=ring)
    try:
      ms, kernels, core_ms = kb.kernel_ms(timed_fn(kernel, variant, splits, ring), timed_args(s, variant),
                                          args.iters, False)
      nbytes = BK * s * (2 * dm.Q + (0 if variant.split("+")[0] == "codes" else 2 * dm.OUTLIERS))
      row.update(kernel_us=core_ms * 1e3, call_us=ms * 1e3, bytes=nbytes, tb_per_s=nbytes / core_ms / 1e9,
                 kernels=kernels)
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    rows.append(row)
    print("time", json.dumps(row), flush=True)
    write_report(args.out, meta, checks, rows)
  with open(os.path.join(args.out, "oskvp_decode_core_mma.md")) as fh:
    print(fh.read())
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
