"""What the OS-KVP refit at the first flush (`OSKVPMode.refit_at_first_flush`) costs a decode step.

Run:  PYTHONPATH=$PWD python3 -m benchmarks.oskvp_refit_cost [--out=DIR] [--batch=8] [--kv_heads=8] [--head_dim=128]
        [--refit_chunks=8] [--layers=1] [--across=1] [--rows=1,B,3] [--only=all|refit] [--name=oskvp_refit_cost]
--layers caches (`OSKVPMode.from_prefill` on random keys and values, different per layer, window R = 128,
S = --cache_len) and one decode step over them as the model runs it (`kv_cache.before_step`, then each layer's
`extend`, T = 1, the cache's default implementation; no projections or experts) timed: a step that flushes nothing,
steps where every row flushes with its prefill fit (a longer prompt; refit off), and, for each `OSKVPMode.refit_chunk`
of --refit_chunks and each `refit_across_layers` of --across (1: all layers' refits in one fit before the step, 0:
one per layer inside its flush), steps where 1, all and 3 (B > 3) rows, or --rows, flush with a refit (prompts
shorter than the window); each label across layers gives the rows per fit (max(1, refit_chunk // L)). --only=refit
skips the cases without a refit but "no flush". Each timed call starts from the same caches (not donated, so each
copies them: the copy is in every row alike). Writes `<name>_<device>.{json,md}` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from benchmarks import report_files
from benchmarks.timing import median_ms
from moe_jax.kv_cache import before_step
from moe_jax.kv_quant import OSKVPMode


def step_ms(mode: OSKVPMode, lengths: list[int], *, b: int, kh: int, g: int, h: int, cache_len: int,
            repeats: int, layers: int = 1, pre_steps: int = 0) -> tuple[float, int]:
  """(median ms, rows it refits per layer) of one decode step over `layers` caches prefilled to `lengths` (T =
  max(lengths)), after `pre_steps` untimed ones."""
  t = max(lengths)
  keys = jax.random.split(jax.random.key(0), 3 + 2 * layers)
  kvs = [tuple(jax.random.normal(kk, (b, t, kh, h), jnp.float32) for kk in keys[3 + 2 * i:5 + 2 * i])
         for i in range(layers)]
  prefill = jax.jit(lambda k, v: mode.from_prefill(k, v, jnp.asarray(lengths), cache_len, layer=0))
  caches = tuple(prefill(k, v) for k, v in kvs)
  q = jax.random.normal(keys[0], (b, 1, kh * g, h), jnp.float32)
  nk, nv = (jax.random.normal(kk, (b, 1, kh, h), jnp.float32) for kk in keys[1:3])

  @jax.jit
  def step(caches):  # -> (attention outputs, caches)
    outs = [c.extend(q, nk, nv, jnp.zeros(b, jnp.int32)) for c in before_step(caches)]
    return [o for o, _ in outs], tuple(c for _, c in outs)

  for _ in range(pre_steps):
    caches = step(caches)[1]
  first = caches[0]
  refits = 0 if first.refit is None else int(jnp.sum(first.refit & (first.n_res == first.window)))
  return median_ms(lambda: step(caches), repeats), refits


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--group", type=int, default=4, help="query heads per kv head")
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--window", type=int, default=128)
  p.add_argument("--cache_len", type=int, default=4096)
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--refit_chunks", default="8", help="comma-separated OSKVPMode.refit_chunk values")
  p.add_argument("--layers", type=int, default=1, help="layer caches in the step")
  p.add_argument("--across", default="1", help="comma-separated OSKVPMode.refit_across_layers values (1 or 0)")
  p.add_argument("--rows", default="", help="comma-separated rows flushing with a refit (default: 1, B, 3)")
  p.add_argument("--only", default="all", choices=("all", "refit"), help="refit: no prefill-fit / refit-off rows")
  p.add_argument("--name", default="oskvp_refit_cost", help="results file stem")
  a = p.parse_args(argv)
  b, r = a.batch, a.window
  shape = dict(b=b, kh=a.kv_heads, g=a.group, h=a.head_dim, cache_len=a.cache_len, repeats=a.repeats,
               layers=a.layers)
  mode = OSKVPMode(window=r)
  long = r + r  # prefill n_comp = R: coded tokens already, so no refit flag; the window holds R tokens (flushes)
  # (name, mode, prompt lengths, untimed steps first): prompts shorter than R are flagged to refit; one untimed step
  # fills a window of R - 1 tokens, so the timed step flushes it (with its refit)
  cases = [("no flush", mode, [r + 1] * b, 0)]  # window holds 1 token after prefill
  if a.only == "all":
    cases += [("all rows flush, prefill fit", mode, [long] * b, 0),
              ("all rows flush, refit off", dataclasses.replace(mode, refit_at_first_flush=False), [r - 1] * b, 1)]
  flushing = [int(x) for x in a.rows.split(",")] if a.rows else list(dict.fromkeys([1, b] + ([3] if b > 3 else [])))
  if not all(1 <= n <= b for n in flushing):
    p.error(f"--rows={a.rows} must be between 1 and --batch={b}")
  for c in (int(x) for x in a.refit_chunks.split(",")):
    for n in flushing:  # the pairs to compare first
      for across in (bool(int(x)) for x in a.across.split(",")):
        m = dataclasses.replace(mode, refit_chunk=c, refit_across_layers=across)
        per_fit = min(b, max(1, c // a.layers))  # `oskvp_cache._refit_in_chunks`' c across layers
        fits = f", across layers ({per_fit} row{'s' * (per_fit > 1)} a fit)" if across else ", per layer"
        how = f"chunk {c}" + ("" if a.layers == 1 else fits)
        what = "1 row flushes" if n == 1 else (f"all {b} rows flush" if n == b else f"{n} rows flush")
        cases += [(f"{what} with a refit, {how}", m, [r - 1] * n + [r - 2] * (b - n), 1)]
  device = jax.devices()[0].device_kind
  what = "one layer's decode step" if a.layers == 1 else f"a decode step over {a.layers} layers (attention only)"
  head = [f"# OS-KVP refit at the first flush: {what} ({device}, jax {jax.__version__})", "",
          f"B={b}, K={a.kv_heads}, G={a.group}, H={a.head_dim}, R={r}, S={a.cache_len}; median of {a.repeats}.", "",
          "| case | rows refitted (per layer) | ms |", "|---|---|---|"]
  result = {"shape": {k: v for k, v in shape.items() if k != "repeats"} | {"window": r}, "rows": []}
  for i, (name, m, lengths, pre) in enumerate(cases):
    ms, refits = step_ms(m, lengths, pre_steps=pre, **shape)
    result["rows"].append({"case": name, "ms": ms, "rows_refitted": refits})
    lines = head + [f"| {x['case']} | {x['rows_refitted']} | {x['ms']:.3f} |" for x in result["rows"]]
    report_files.write(a.out, a.name, result, lines, echo=i == len(cases) - 1)  # kept should a later case be cut
    print(f"{name}: {ms:.3f} ms ({refits} rows)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
