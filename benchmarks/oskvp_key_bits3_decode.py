"""Decode attention over OS-KVP caches with 3-bit keys (`kv_cache="oskvp_k3v2"`), on the GPU, in one run:

- `oskvp_k3_pallas`: the compact bit-plane kernel reading the keys' third bits (`hi_k`, seven key plane types);
- `oskvp_k2_pallas`: the same kernel on the 2-bit cache (`oskvp`), the speed 3-bit keys give up;
- `oskvp_k3sym_pallas` / `oskvp_k2sym_pallas`: both with symmetric codebooks (`oskvp_k3v2_sym`: four key plane types
  instead of seven; `oskvp_sym`);
- `oskvp_k3_xla_lut` / `oskvp_k3_xla_dequant`: `moe_jax.kv_quant.oskvp_attention`'s XLA forms, the path 3-bit keys
  took before the kernel read them (where their f32 intermediates fit);
- `cudnn_bf16`: `jax.nn.dot_product_attention(implementation="cudnn")` on a bf16 cache.

Shapes as `decode_attention.py` (32 query / 8 kv heads, head dim 128, 8 fp8 outliers, window 128, random caches).
First checks the kernel against the reference on the GPU (poisoned outputs; mixed lengths; G = 1, 4, 8).

  python benchmarks/oskvp_key_bits3_decode.py --out=DIR [--contexts=4096,16384,65536] [--batches=1,8,32]

Writes DIR/oskvp_key_bits3_decode_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import warnings

import jax
import jax.numpy as jnp

from benchmarks import report_files
from benchmarks.chained_timing import copy_bandwidth, timeit
from benchmarks.decode_attention import (HEAD_DIM, KV_HEADS, N_HEADS, WINDOW, bf16_cache, cudnn_bf16, oskvp_bytes)
from moe_jax.kv_quant.oskvp_attention import oskvp_decode_attention_xla
from pallas_kernels.oskvp_decode_attention import BITPLANE, _oskvp_pallas, oskvp_decode_attention_reference
from pallas_kernels.oskvp_random import random_oskvp_inputs

warnings.filterwarnings("ignore", category=DeprecationWarning)


def k3_bytes(b: int, s: int) -> int:
  """`oskvp_bytes` plus the keys' third bits (H/8 a token and kv head) and the larger key codebooks."""
  return oskvp_bytes(b, s) + b * KV_HEADS * (s * HEAD_DIM // 8 + HEAD_DIM * 4 * 4)


def cache(i: int, b: int, s: int, key_bits: int, symmetric: bool = False):
  return random_oskvp_inputs(jax.random.key(i), batch=b, heads=N_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             capacity=s, window=WINDOW, key_bits=key_bits, symmetric=symmetric)


def kernel(*a, config=BITPLANE, symmetric=False):
  return _oskvp_pallas(*a[:15], a[15] if len(a) > 15 else None, interpret=False, config=config,
                       symmetric_codebooks=symmetric)


# Tilings tried for 3-bit keys at 64k x 8 (seven key plane types hold more of the query in registers than three).
SWEEP = {"block_s=128": dict(block_s=128), "num_warps=8": dict(num_warps=8), "num_stages=2": dict(num_stages=2)}


def check(log) -> list[dict]:
  """Kernel (poisoned partials) vs reference on 3-bit-key caches: relative L2 error, NaNs."""
  rows = []
  cases = [dict(batch=4, heads=16, kv_heads=4, capacity=4097, window=128, n_comp=[1, 127, 1000, 4097],
                n_res=[0, 128, 77, 5]),
           dict(batch=2, heads=8, kv_heads=8, capacity=1000, window=64, n_comp=[999, 3], n_res=[64, 1]),
           dict(batch=2, heads=16, kv_heads=2, capacity=2048, window=128, n_comp=[2048, 0], n_res=[1, 128])]
  for (i, case), sym in itertools.product(enumerate(cases), (False, True)):
    *args, hi_k = random_oskvp_inputs(jax.random.key(50 + i), head_dim=HEAD_DIM, key_bits=3, symmetric=sym, **case)
    ref = oskvp_decode_attention_reference(*args, hi_k=hi_k).astype(jnp.float32)
    out = _oskvp_pallas(*args, hi_k, interpret=False, config=BITPLANE, poison=True,
                        symmetric_codebooks=sym).astype(jnp.float32)
    row = dict(case=i, g=case["heads"] // case["kv_heads"], symmetric=sym,
               rel_err=float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)), nan=bool(jnp.isnan(out).any()))
    rows.append(row)
    log(f"check {row}")
  return rows


def render_md(device: str, copy_tbs: float, checks: list[dict], rows: list[dict]) -> list[str]:
  """The results table: each row with its ratios to cuDNN and to the 2-bit kernel at the same shape."""
  by = {(r["impl"], r["batch"], r["context"]): r["ms"] for r in rows}
  md = [f"# Decode attention with 3-bit keys ({device}, jax {jax.__version__}, "
        f"{datetime.datetime.now(datetime.UTC).isoformat()[:16]} UTC)", "",
        f"N={N_HEADS} query / K={KV_HEADS} kv heads, H={HEAD_DIM}, 8 fp8 outliers, window {WINDOW}; random caches. "
        f"Wall-clock ms per call (`chained_timing.timeit`). Copy bandwidth in this run: {copy_tbs:.2f} TB/s.", "",
        "Checks (3-bit keys, kernel vs reference, poisoned partials): " +
        ", ".join(f"G={c['g']}{' sym' if c.get('symmetric') else ''} rel err {c['rel_err']:.1e}"
                  f"{' NaN' if c['nan'] else ''}" for c in checks), "",
        "| impl | batch | context | ms | bytes read | TB/s | of copy BW | vs cuDNN | vs oskvp_k2_pallas |",
        "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    key = (r["batch"], r["context"])
    ratio = lambda impl, key=key, r=r: (f"{by[(impl, *key)] / r['ms']:.2f}x" if (impl, *key) in by else "-")
    md.append(f"| {r['impl']} | {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['bytes_read'] / 1e6:.1f} MB | "
              f"{r['tb_per_s']:.2f} | {r['frac_copy_bw']:.0%} | {ratio('cudnn_bf16')} | {ratio('oskvp_k2_pallas')} |")
  return md + ["", "\"vs X\" is X's ms over this row's ms (> 1: this row is faster)."]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--contexts", default="4096,16384,65536")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--xla_max_gb", type=float, default=24.0, help="skip XLA forms whose f32 one-hot exceeds this")
  args = ap.parse_args()
  log = lambda msg: print(msg, flush=True)
  dev = jax.devices()[0]
  log(f"device {dev.device_kind}, jax {jax.__version__}")
  copy_tbs, _ = copy_bandwidth()
  checks = check(log)
  ok = all(c["rel_err"] < 1.5e-2 and not c["nan"] for c in checks)
  if not ok:
    log("the kernel failed its check; no timings of it")
  rows = []

  def save():  # after every row: a run cut short by its time limit keeps what it measured
    report_files.write(args.out, "oskvp_key_bits3_decode", dict(copy_tb_per_s=copy_tbs, checks=checks, rows=rows),
                       render_md(dev.device_kind, copy_tbs, checks, rows), echo=False)

  def attempt(impl, b, s, fn, make_args, nbytes):
    try:
      ms = timeit(fn, make_args, nbytes)
    except Exception as e:  # pylint: disable=broad-except
      log(f"{impl} B={b} S={s} failed: {repr(e)[:300]}")
      return
    rows.append(dict(impl=impl, batch=b, context=s, ms=ms, bytes_read=int(nbytes), tb_per_s=nbytes / ms / 1e9,
                     frac_copy_bw=nbytes / ms / 1e9 / copy_tbs))
    log(f"{impl:22s} B={b:3d} S={s:7d} {ms:8.4f} ms {nbytes / ms / 1e9:6.2f} TB/s")
    save()

  if ok and "65536" in args.contexts.split(","):
    for name, change in SWEEP.items():
      cfg = dataclasses.replace(BITPLANE, **change)
      attempt(f"oskvp_k3_pallas_{name}", 8, 65536, lambda *a, cfg=cfg: kernel(*a, config=cfg),
              lambda i: cache(i, 8, 65536, 3), k3_bytes(8, 65536))
  for s in [int(x) for x in args.contexts.split(",")]:
    for b in [int(x) for x in args.batches.split(",")]:
      if ok:
        attempt("oskvp_k3_pallas", b, s, kernel, lambda i: cache(i, b, s, 3), k3_bytes(b, s))
      attempt("oskvp_k2_pallas", b, s, kernel, lambda i: cache(i, b, s, 2), oskvp_bytes(b, s))
      if ok:
        attempt("oskvp_k3sym_pallas", b, s, functools.partial(kernel, symmetric=True),
                lambda i: cache(i, b, s, 3, True), k3_bytes(b, s))
      attempt("oskvp_k2sym_pallas", b, s, functools.partial(kernel, symmetric=True),
              lambda i: cache(i, b, s, 2, True), oskvp_bytes(b, s))
      if b * KV_HEADS * s * HEAD_DIM * 8 * 4 <= args.xla_max_gb * 1e9:
        for form in ("lut", "dequant"):
          fn = lambda *a, form=form: oskvp_decode_attention_xla(*a[:15], hi_k=a[15], form=form)
          attempt(f"oskvp_k3_xla_{form}", b, s, fn, lambda i: cache(i, b, s, 3), k3_bytes(b, s))
      bf_bytes = 2 * b * KV_HEADS * s * HEAD_DIM * 2
      make = lambda i: (jax.random.normal(jax.random.key(i), (b, N_HEADS, HEAD_DIM), jnp.bfloat16),
                        *[x.transpose(0, 2, 1, 3) for x in bf16_cache(jax.random.key(i), b, s)])
      attempt("cudnn_bf16", b, s, cudnn_bf16, make, bf_bytes)

  save()


if __name__ == "__main__":
  main()
