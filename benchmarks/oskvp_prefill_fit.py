"""What building a model's OS-KVP caches at prefill costs: every layer fitted on its own against the layers' fits
batched (`OSKVPMode.prefill_across_layers`, `prefill_fit_chunk`).

Run:  PYTHONPATH=$PWD python3 -m benchmarks.oskvp_prefill_fit [--out=DIR] [--layers=48] [--batches=1,8]
        [--prompt=4096] [--kv_heads=8] [--head_dim=128] [--chunks=8,16,48] [--xla_chunks=] [--repeats=10]
        [--name=oskvp_prefill_fit]
For each batch B: --layers pairs of keys and values [B, --prompt, K, H] in bf16 (a decaying spectrum over the
channels, a different random mixing per layer, as a prefill hands them over), and the jitted
`OSKVPMode.from_prefill_layers` (`kv_cache.prefill_layers`, what `Transformer.prefill` calls after its last layer)
timed with `prefill_across_layers=False` (one fit per layer) and with each chunk of --chunks (max(1, chunk // B)
layers a fit), with the mode's default `fit_implementation="auto"` (which may take the Lloyd kernel for a batched fit
and the XLA form for one layer's), and with --xla_chunks both again with the XLA form throughout. --compile_only instead compiles each case for
abstract inputs and reports its compile time and temporaries (what the CPU can say). Each row gives the median ms, the fit calls, and the compiled program's temporary bytes
(`memory_analysis().temp_size_in_bytes`). The default mode otherwise (2 bits, 8% fp8, window 128, 4096 fitted
samples a head: 512 prompt tokens x 8 RoPE shifts for keys). Writes `<name>_<device>.{json,md}` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import report_files
from benchmarks.timing import median_ms
from moe_jax.kv_cache import prefill_layers
from moe_jax.kv_quant import OSKVPMode


def layer_kvs(n_layers: int, b: int, t: int, kh: int, h: int) -> list[tuple[jax.Array, jax.Array]]:
  """One (k, v) bf16 [B, T, K, H] per layer: standard normals times a decaying spectrum, mixed by a random
  orthogonal matrix of the layer (so that each layer's basis is its own to fit)."""
  spectrum = jnp.exp(-jnp.arange(h) / (h / 8))

  @jax.jit
  def one(key):
    out = []
    for kk in jax.random.split(key, 2):
      z_key, q_key = jax.random.split(kk)
      mix = jnp.linalg.qr(jax.random.normal(q_key, (h, h)))[0]
      out.append((jax.random.normal(z_key, (b, t, kh, h)) * spectrum @ mix).astype(jnp.bfloat16))
    return tuple(out)

  return [one(jax.random.key(i)) for i in range(n_layers)]


def temp_bytes(compiled) -> int:
  """The compiled program's temporary bytes by its memory analysis (-1 where the backend gives none)."""
  analysis = compiled.memory_analysis()
  return int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis is not None else -1


def time_case(mode: OSKVPMode, kvs, lengths: jax.Array, cache_len: int, repeats: int) -> tuple[float, int, tuple]:
  """(median ms, temporary bytes of the compiled program, the caches) of building every layer's cache."""
  build = jax.jit(lambda kvs: prefill_layers(mode, kvs, lengths, cache_len))
  compiled = build.lower(kvs).compile()
  return median_ms(lambda: compiled(kvs), repeats), temp_bytes(compiled), compiled(kvs)


def compile_case(mode: OSKVPMode, kvs, lengths, cache_len: int) -> tuple[float, int]:
  """(seconds to lower and compile, temporary bytes) of the build for abstract inputs (`--compile_only`)."""
  t0 = time.perf_counter()
  compiled = jax.jit(lambda kvs, n: prefill_layers(mode, kvs, n, cache_len)).lower(kvs, lengths).compile()
  return time.perf_counter() - t0, temp_bytes(compiled)


def relative_error(caches, kvs) -> float:
  """Mean over layers and sides of |x̂ - x|² / |x|² over the prompt: how well the caches represent what they store
  (a sign flipped by an eigensolver changes U and the codes, not this)."""
  errs = []
  for cache, (k, v) in zip(caches, kvs):
    t = k.shape[1]
    for x_hat, x in zip(cache.dequantized(), (k, v)):
      x = x.astype(jnp.float32)
      errs.append(float(jnp.sum((x_hat[:, :t] - x) ** 2) / jnp.sum(x * x)))
  return sum(errs) / len(errs)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--layers", type=int, default=48)
  p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
  p.add_argument("--prompt", type=int, default=4096, help="prompt tokens (every row this long)")
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--window", type=int, default=128)
  p.add_argument("--chunks", default="8,16,48", help="comma-separated OSKVPMode.prefill_fit_chunk values")
  p.add_argument("--per_layer", type=int, default=1, help="1: also time one fit per layer (the baseline)")
  p.add_argument("--xla_chunks", default="",
                 help="comma-separated chunks also timed with the Lloyd iterations' XLA form, and then the per-layer "
                      "build too (fit_implementation='xla'): 'auto' may take the kernel for a batched fit only")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--compile_only", action="store_true",
                 help="no run: each case's compile time and temporaries for abstract inputs (the CPU's figures)")
  p.add_argument("--name", default="oskvp_prefill_fit", help="results file stem")
  a = p.parse_args(argv)
  batches = [int(x) for x in a.batches.split(",")]
  chunks = [int(x) for x in a.chunks.split(",")]
  xla_chunks = [int(x) for x in a.xla_chunks.split(",")] if a.xla_chunks else []
  if a.layers < 1 or min(batches) < 1 or min(chunks + xla_chunks) < 1 or a.prompt < 1:
    p.error("--layers, --batches, --chunks, --xla_chunks and --prompt must be >= 1")
  mode = OSKVPMode(window=a.window)
  cache_len = a.prompt + a.window
  device = jax.devices()[0].device_kind
  head = [f"# OS-KVP caches built at prefill: {a.layers} layers, fits per layer against batched "
          f"({device}, jax {jax.__version__})", "",
          f"Prompt {a.prompt} tokens, K={a.kv_heads}, H={a.head_dim}, R={a.window}, S={cache_len}; "
          f"median of {a.repeats}; temporaries from the compiled program's memory analysis.", "",
          "Relative error: the caches' mean |x̂ - x|² / |x|² over layers, keys and values (the same fits give the "
          "same error).", "",
          "| B | fits | calls | ms | temporaries (MiB) | × per layer | relative error |",
          "|---|---|---|---|---|---|---|"]
  result = {"shape": dict(layers=a.layers, prompt=a.prompt, kv_heads=a.kv_heads, head_dim=a.head_dim,
                          window=a.window, cache_len=cache_len, repeats=a.repeats), "rows": []}

  def line(r):
    if a.compile_only:
      return f"| {r['batch']} | {r['case']} | {r['fit_calls']} | {r['compile_s']:.1f} | {r['temp_bytes'] / 2**20:.0f} |"
    ratio = f"{r['speedup']:.2f}×" if r.get("speedup") else "–"
    return (f"| {r['batch']} | {r['case']} | {r['fit_calls']} | {r['ms']:.2f} | {r['temp_bytes'] / 2**20:.0f} | "
            f"{ratio} | {r['rel_err']:.6f} |")

  if a.compile_only:
    head[2] = (f"Prompt {a.prompt} tokens, K={a.kv_heads}, H={a.head_dim}, R={a.window}, S={cache_len}; each case "
               "lowered and compiled once for abstract inputs; temporaries from the compiled program's memory analysis.")
    head[4:] = ["| B | fits | calls | compile s | temporaries (MiB) |", "|---|---|---|---|---|"]

  for b in batches:
    if a.compile_only:
      kvs = [tuple(jax.ShapeDtypeStruct((b, a.prompt, a.kv_heads, a.head_dim), jnp.bfloat16) for _ in (0, 1))
             for _ in range(a.layers)]
      lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    else:
      kvs = layer_kvs(a.layers, b, a.prompt, a.kv_heads, a.head_dim)
      lengths = jnp.full((b,), a.prompt, jnp.int32)
    cases = []
    for impl, these in (("auto", chunks), ("xla", xla_chunks)):
      if not these:
        continue
      tag = "" if impl == "auto" else ", Lloyd xla"
      m_impl = dataclasses.replace(mode, fit_implementation=impl)
      if a.per_layer:
        cases.append(("per layer" + tag, dataclasses.replace(m_impl, prefill_across_layers=False), a.layers))
      for c in these:
        per_fit = min(a.layers, max(1, c // b))
        calls = -(-a.layers // per_fit)
        per_fit = -(-a.layers // calls)
        cases.append((f"chunk {c} ({per_fit} layer{'s' * (per_fit > 1)} a fit){tag}",
                      dataclasses.replace(m_impl, prefill_fit_chunk=c), calls))
    base = None
    for name, m, calls in cases:
      if a.compile_only:
        seconds, temp = compile_case(m, kvs, lengths, cache_len)
        result["rows"].append({"batch": b, "case": name, "fit_calls": calls, "compile_s": seconds, "temp_bytes": temp})
        print(f"B={b} {name}: compiled in {seconds:.1f} s, {temp / 2**20:.0f} MiB temporaries", flush=True)
        continue
      ms, temp, caches = time_case(m, kvs, lengths, cache_len, a.repeats)
      if name.startswith("per layer"):  # each Lloyd form against its own per-layer build
        base = None
      row = {"batch": b, "case": name, "fit_calls": calls, "ms": ms, "temp_bytes": temp,
             "speedup": None if base is None else base / ms}
      row["rel_err"] = relative_error(caches, kvs)
      base = ms if name.startswith("per layer") else base
      del caches
      result["rows"].append(row)
      report_files.write(a.out, a.name, result, head + [line(r) for r in result["rows"]], echo=False)
      print(f"B={b} {name}: {ms:.2f} ms, {calls} fit calls, {temp / 2**20:.0f} MiB temporaries", flush=True)
    del kvs
  report_files.write(a.out, a.name, result, head + [line(r) for r in result["rows"]])
  return 0


if __name__ == "__main__":
  sys.exit(main())
