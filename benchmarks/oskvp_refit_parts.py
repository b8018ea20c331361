"""Where the OS-KVP refit's time goes: its parts timed alone, one layer (`oskvp_refit_cost.py` times the whole step).

Run:  PYTHONPATH=$PWD python3 -m benchmarks.oskvp_refit_parts [--out=DIR] [--batch=8] [--kv_heads=8] [--head_dim=128]
A row's refit (`oskvp_cache._refit_layers_rows`; one row at a time, two eigh calls, before 2026-12-06) fits keys
(RoPE-shifted copies, R x rope_shifts samples per head) and values (R samples) on its R window tokens. Each fit is a
covariance, an eigendecomposition per kv head (H x H) and a Lloyd-Max scan. This times, with jitted calls on random
inputs (median wall ms):
- both fits for 1 row and for all B rows at once (the fits batched), each also as `OSKVPMode.fit_keys_values` (one
  eigh call for both sides);
- `jnp.linalg.eigh` on K, B*K and 2*B*K matrices of H x H, the default and the Jacobi implementation (GPU only);
- the codebooks' Lloyd-Max iterations over K and B*K heads of R x rope_shifts samples, by XLA (`lloyd.lloyd_max`,
  on sorted samples) and by the Pallas kernel (`pallas_kernels/lloyd_max.py`; interpreted off the GPU), with the
  largest difference of their levels;
- with --kernels (GPU): the kernels of one B-row `fit_keys_values` call by CUPTI, grouped by name, the 15 longest.
Writes `oskvp_refit_parts_<device>.{json,md}` under --out.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks import report_files
from benchmarks.timing import median_ms
from moe_jax.kv_quant import OSKVPMode, oskvp
from moe_jax.kv_quant.lloyd import fit_levels as lloyd_levels


def _spd(key, n: int, h: int, samples: int) -> jax.Array:
  """[n, h, h] covariances of `samples` random rows each."""
  x = jax.random.normal(key, (n, samples, h), jnp.float32) * jnp.linspace(0.1, 3.0, h)
  return jnp.einsum("nsh,nsj->nhj", x, x) / samples


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--window", type=int, default=128)
  p.add_argument("--cache_len", type=int, default=4096)
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--kernels", action="store_true", help="break the B-row fit down by kernel (CUPTI; GPU only)")
  p.add_argument("--fit_implementation", default="auto", choices=("auto", "pallas", "xla"),
                 help="OSKVPMode.fit_implementation of the fits (the Lloyd iterations)")
  a = p.parse_args(argv)
  if a.kernels and jax.default_backend() != "gpu":
    p.error(f"--kernels times kernels by CUPTI and needs a GPU (backend here: {jax.default_backend()})")
  b, kh, h, r = a.batch, a.kv_heads, a.head_dim, a.window
  mode = OSKVPMode(window=r, fit_implementation=a.fit_implementation)
  keys = jax.random.split(jax.random.key(0), 4)
  x1 = jax.random.normal(keys[0], (1, r, kh, h), jnp.float32)
  xb = jax.random.normal(keys[1], (b, r, kh, h), jnp.float32)
  fits = jax.jit(lambda x: (mode.fit(x, jnp.full((x.shape[0],), r, jnp.int32), rope_span=a.cache_len),
                            mode.fit(x, jnp.full((x.shape[0],), r, jnp.int32))))
  key_fit = jax.jit(lambda x: mode.fit(x, jnp.full((x.shape[0],), r, jnp.int32), rope_span=a.cache_len))
  value_fit = jax.jit(lambda x: mode.fit(x, jnp.full((x.shape[0],), r, jnp.int32)))
  shared = jax.jit(lambda x: mode.fit_keys_values(x, x, jnp.full((x.shape[0],), r, jnp.int32), rope_span=a.cache_len))
  rows = []

  def add(name: str, fn, *args):
    ms = median_ms(lambda: fn(*args), a.repeats)
    rows.append({"part": name, "ms": ms})
    print(f"{name}: {ms:.3f} ms", flush=True)

  add("key + value fit, 1 row", fits, x1)
  add("key + value fit, one eigh call, 1 row", shared, x1)
  add("key fit, 1 row", key_fit, x1)
  add("value fit, 1 row", value_fit, x1)
  add(f"key + value fit, {b} rows at once", fits, xb)
  add(f"key + value fit, one eigh call, {b} rows at once", shared, xb)
  samples = r * mode.rope_shifts
  for n in (kh, b * kh, 2 * b * kh):
    c = _spd(keys[2], n, h, samples)
    add(f"eigh {n} x {h}x{h}, default", jax.jit(jnp.linalg.eigh), c)
    jacobi = jax.jit(lambda c: jax.lax.linalg.eigh(c, implementation=jax.lax.linalg.EighImplementation.JACOBI))
    try:
      add(f"eigh {n} x {h}x{h}, jacobi", jacobi, c)
    except Exception as e:  # pylint: disable=broad-except  # CPU has no Jacobi: say so and go on
      print(f"eigh jacobi: {type(e).__name__}: {str(e)[:120]}")
  def lloyd(impl):
    return jax.jit(jax.vmap(lambda x, i: lloyd_levels(x, jnp.ones(x.shape[0]), i, mode.n_iters,
                                                      implementation=impl)))

  for n in (kh, b * kh):
    xs = jax.random.normal(keys[3], (n, samples, h), jnp.float32)
    init = jnp.broadcast_to(jnp.asarray(oskvp.GAUSSIAN_LEVELS[4], jnp.float32), (n, h, 4))
    for impl in ("xla", "pallas"):
      add(f"lloyd_max {n} heads x {samples} samples, {mode.n_iters} iters, {impl}", lloyd(impl), xs, init)
    diff = float(jnp.max(jnp.abs(lloyd("xla")(xs, init) - lloyd("pallas")(xs, init))))
    rows[-1]["max_abs_diff_vs_xla"] = diff  # unit-variance samples: an absolute difference is a relative one
    print(f"lloyd_max {n} heads: pallas - xla levels, max |diff| {diff:.2e}", flush=True)
  device = jax.devices()[0].device_kind
  result = {"shape": {"b": b, "kh": kh, "h": h, "window": r, "cache_len": a.cache_len,
                      "rope_shifts": mode.rope_shifts, "n_iters": mode.n_iters},
            "fit_implementation": a.fit_implementation, "rows": rows}
  lines = [f"# OS-KVP refit, its parts alone ({device}, jax {jax.__version__})", "",
           f"B={b}, K={kh}, H={h}, R={r}, rope_shifts={mode.rope_shifts}, Lloyd iterations {mode.n_iters}, fits' "
           f"Lloyd: {a.fit_implementation}; median wall ms of {a.repeats} jitted calls.", "", "| part | ms |", "|---|---|"]
  lines += [f"| {x['part']} | {x['ms']:.3f} |" for x in rows]
  lines += ["", "Pallas against XLA Lloyd-Max levels (unit-variance samples), max |diff|: "
            + ", ".join(f"{x['part'].split(' x ')[0]}: {x['max_abs_diff_vs_xla']:.2e}" for x in rows
                        if "max_abs_diff_vs_xla" in x)]
  if a.kernels:
    from benchmarks import cupti  # pylint: disable=g-import-not-at-top
    _, timings = cupti.cupti_kernels(lambda: shared(xb))  # compiled and warm: timed above
    result["kernels"] = cupti.kernel_table(timings)
    total = sum(ms for _, ms in timings)
    lines += ["", f"Kernels of one {b}-row `fit_keys_values` call (CUPTI): {len(timings)} launches, {total:.3f} ms "
              "summed; the 15 longest groups:", "", "| kernel | count | ms |", "|---|---|---|"]
    lines += [f"| `{x['kernel']}` | {x['count']} | {x['ms']:.3f} |" for x in result["kernels"]]
  report_files.write(a.out, "oskvp_refit_parts", result, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
