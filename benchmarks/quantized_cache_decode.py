"""The decode kernels of the baseline compressed caches on the H200, side by side with cuDNN on a bf16 cache and
the XLA paths, in one run: `pallas_kernels/per_token_decode_attention.py` (kv_cache fp8 / int8) and
`pallas_kernels/kivi_decode_attention.py` (kivi2, the cache's own format: 32-token key groups, 32-channel value
groups, a 128-token bf16 window).

1. Checks each kernel against its f32 reference at 4k × batch 8 and at ragged lengths; stops on a miss.
2. Sweeps the per-token kernel's (block_s, num_warps, num_stages) at 64k × batch 8 (fp8) and keeps the fastest.
3. Times cuDNN bf16, XLA int8/fp8/kivi2 (dequantize to bf16 inside the einsums) and the kernels over the grid.
Writes `quantized_cache_decode.md` / `.json` under --out (rows: impl, batch, context, ms, bytes_read, tb_per_s,
frac_copy_bw, note).

  PYTHONPATH=$PWD python3 benchmarks/quantized_cache_decode.py --out=$OUT   # ~4 min on the H200
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_attention as da  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import chained_timing as ct  # pylint: disable=wrong-import-position
from moe_jax.kv_quant import kivi  # pylint: disable=wrong-import-position
from pallas_kernels import kivi_decode_attention as kd  # pylint: disable=wrong-import-position
from pallas_kernels import per_token_decode_attention as ptda  # pylint: disable=wrong-import-position

QUANT = {"int8": da.quant_int8, "fp8": da.quant_fp8}
SWEEP = list(itertools.product((32, 64, 128), (4, 8), (2, 3)))  # block_s, num_warps, num_stages


def scaled_args(i, b, s, dtype):
  """The XLA rows' inputs (`decode_attention.xla_scaled`): q [B, N, H] bf16, k [B, K, S, H] 8-bit, k_scale
  [B, K, S], v, v_scale."""
  q = jax.random.normal(jax.random.key(i), (b, da.N_HEADS, da.HEAD_DIM), jnp.bfloat16)
  k, v = da.bf16_cache(jax.random.key(i), b, s)  # [B, K, S, H]
  return (q, *QUANT[dtype](k), *QUANT[dtype](v))


def cache_args(i, b, s, dtype, lengths=None):
  """The kernel's inputs, the same values in the cache's layout (`decode_attention.per_token_args`): q, k, v
  [B, S, K, H], k_scale, v_scale [B, S, K], lengths [B] (default: all S)."""
  args = da.per_token_args(i, b=b, s=s, make=lambda i: scaled_args(i, b, s, dtype))
  return args if lengths is None else (*args[:-1], jnp.asarray(lengths, jnp.int32))


def kivi_args(i, b, s, n_comp=None, n_res=None):
  """(q, the KIVI-2 cache's leaves at capacity S (all compressed) and a full 128-token window, n_comp, n_res)."""
  q = jax.random.normal(jax.random.key(i), (b, da.N_HEADS, da.HEAD_DIM), jnp.bfloat16)
  k, v = da.bf16_cache(jax.random.key(i), b, s)  # [B, K, S, H]
  rk, rv = da.bf16_cache(jax.random.key(i + 1), b, da.WINDOW)
  ck, ksc, kz = kivi.quantize_keys(k.astype(jnp.float32))
  cv, vsc, vz = kivi.quantize_values(v.astype(jnp.float32))
  n_comp = jnp.full((b,), s, jnp.int32) if n_comp is None else jnp.asarray(n_comp, jnp.int32)
  n_res = jnp.full((b,), da.WINDOW, jnp.int32) if n_res is None else jnp.asarray(n_res, jnp.int32)
  return q, ck, ksc, kz, cv, vsc, vz, rk, rv, n_comp, n_res


def xla_kivi2(q, ck, ksc, kz, cv, vsc, vz, rk, rv, n_comp, n_res):
  """The XLA peer: both stores dequantized to bf16 inside the einsums (the window concatenated), masked softmax."""
  b, n, h = q.shape
  k, v, live = kd.dequantized_tokens(ck, ksc, kz, cv, vsc, vz, rk, rv, n_comp, n_res, dtype=jnp.bfloat16)
  qg = q.reshape(b, da.KV_HEADS, n // da.KV_HEADS, h)
  sc = jnp.einsum("BKGH,BKSH->BKGS", qg, k, preferred_element_type=jnp.float32) * h**-0.5
  p = jax.nn.softmax(jnp.where(live[:, None, None, :], sc, -jnp.inf), axis=-1)
  return jnp.einsum("BKGS,BKSH->BKGH", p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32).reshape(b, n, h)


def kivi_bytes(b, s):
  h = da.HEAD_DIM
  return b * da.KV_HEADS * (2 * s * h // 4 + 2 * 2 * (s // kivi.GROUP) * h + 2 * 2 * s * (h // kivi.GROUP)
                            + 2 * da.WINDOW * h * 2)


def check(log) -> bool:
  ok = True
  cases = [(f"per-token {dtype}", ptda.per_token_decode_attention, ptda.per_token_decode_attention_reference,
            cache_args(0, b, s, dtype, lengths))
           for dtype, (b, s, lengths) in itertools.product(QUANT, ((8, 4096, None), (4, 4352, [1, 127, 1000, 4097])))]
  cases += [("kivi2", kd.kivi_decode_attention, kd.kivi_decode_attention_reference, kivi_args(0, b, s, nc, nr))
            for b, s, nc, nr in ((8, 4096, None, None), (4, 4096, [0, 32, 992, 4096], [1, 128, 0, 77]))]
  for name, fn, ref, args in cases:
    err, nan = da.rel_err_vs(fn, ref, args)
    log(f"check {name} B={args[0].shape[0]}: max rel err {err:.2e} nan={nan}")
    ok &= err < 1e-2 and not nan
  return ok


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/quantized_cache_decode")
  ap.add_argument("--contexts", default="4096,16384,65536,131072")
  ap.add_argument("--batches", default="1,8,32")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  logf = open(os.path.join(args.out, "log.txt"), "w")

  def log(msg):
    print(msg, flush=True)
    logf.write(msg + "\n")
    logf.flush()

  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  log(f"device {meta['device']}, jax {meta['jax']}")
  copy_tbs, _ = ct.copy_bandwidth()
  log(f"copy bandwidth {copy_tbs:.2f} TB/s")
  if not check(log):
    log("the kernel failed its check; stopping before the timings")
    return 1
  rows = []

  def record(impl, b, s, fn, make_args, nbytes, note=""):
    try:
      ms = ct.timeit(fn, make_args, nbytes)
    except Exception as e:  # pylint: disable=broad-except
      log(f"{impl} B={b} S={s} failed: {repr(e)[:300]}")
      return None
    rows.append(dict(impl=impl, batch=b, context=s, ms=ms, bytes_read=int(nbytes), tb_per_s=nbytes / ms / 1e9,
                     frac_copy_bw=nbytes / ms / 1e9 / copy_tbs, note=note))
    log(f"{impl:22s} B={b:3d} S={s:7d} {ms:8.4f} ms {rows[-1]['tb_per_s']:5.2f} TB/s {note}")
    return ms

  scaled_bytes = lambda b, s: 2 * b * da.KV_HEADS * s * (da.HEAD_DIM + 4)
  sweep = {}
  for cfg in SWEEP:
    kw = dict(zip(("block_s", "num_warps", "num_stages"), cfg))
    sweep[cfg] = record("sweep_pallas_fp8", 8, 65536, functools.partial(ptda.per_token_decode_attention, **kw),
                        lambda i: cache_args(i, 8, 65536, "fp8"), scaled_bytes(8, 65536), str(kw))
  best = min((c for c in sweep if sweep[c] is not None), key=sweep.get, default=(64, 4, 2))
  best_kw = dict(zip(("block_s", "num_warps", "num_stages"), best))
  log(f"best config {best_kw}")

  for s, b in itertools.product([int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")]):
    record("cudnn_bf16", b, s, da.cudnn_bf16,
           lambda i, b=b, s=s: (lambda q, k, v: (q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)))(
               jax.random.normal(jax.random.key(i), (b, da.N_HEADS, da.HEAD_DIM), jnp.bfloat16),
               *da.bf16_cache(jax.random.key(i), b, s)),
           2 * b * da.KV_HEADS * s * da.HEAD_DIM * 2)
    for dtype in QUANT:
      record(f"xla_{dtype}", b, s, da.xla_scaled, lambda i, b=b, s=s, dtype=dtype: scaled_args(i, b, s, dtype),
             scaled_bytes(b, s))
      record(f"pallas_{dtype}", b, s, functools.partial(ptda.per_token_decode_attention, **best_kw),
             lambda i, b=b, s=s, dtype=dtype: cache_args(i, b, s, dtype), scaled_bytes(b, s), str(best_kw))
    record("xla_kivi2", b, s, xla_kivi2, lambda i, b=b, s=s: kivi_args(i, b, s), kivi_bytes(b, s))
    record("pallas_kivi2", b, s, kd.kivi_decode_attention, lambda i, b=b, s=s: kivi_args(i, b, s), kivi_bytes(b, s))

  result = {**meta, "copy_tb_per_s": copy_tbs, "best_config": best_kw, "rows": rows}
  with open(os.path.join(args.out, "quantized_cache_decode.json"), "w") as f:
    json.dump(result, f, indent=1)
  cudnn = {(r["batch"], r["context"]): r["ms"] for r in rows if r["impl"] == "cudnn_bf16"}
  lines = [f"# Decode attention over fp8 / int8 / kivi2 caches ({meta['device']}, jax {meta['jax']}, {meta['date']})",
           "",
           f"Copy bandwidth {copy_tbs:.2f} TB/s; 32 query / 8 kv heads, H = 128; best config {best_kw}.", "",
           "| impl | batch | context | ms | TB/s | of copy BW | vs cuDNN | note |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ref = cudnn.get((r["batch"], r["context"]))
    ratio = f"{ref / r['ms']:.2f}×" if ref and not r["impl"].startswith("sweep") else ""
    lines.append(f"| {r['impl']} | {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['tb_per_s']:.2f} | "
                 f"{r['frac_copy_bw']:.0%} | {ratio} | {r['note']} |")
  with open(os.path.join(args.out, "quantized_cache_decode.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
