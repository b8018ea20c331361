"""What the OS-KVP refit at the first flush (`OSKVPMode.refit_at_first_flush`) costs a decode step, per layer.

Run:  PYTHONPATH=$PWD python3 -m benchmarks.oskvp_refit_cost [--out=DIR] [--batch=8] [--kv_heads=8] [--head_dim=128]
        [--refit_chunks=8] [--name=oskvp_refit_cost]
One layer's cache (`OSKVPMode.from_prefill` on random keys and values, window R = 128, S = --cache_len) and one
decode step (`extend`, T = 1, the cache's default implementation) timed: a step that flushes nothing, steps where every
row flushes with its prefill fit (a longer prompt; refit off), and, for each `OSKVPMode.refit_chunk` of
--refit_chunks, steps where 1, 3 (B > 3) and all rows flush with a refit (prompts shorter than the window). Each
timed call starts from the same cache (not donated, so each copies it: the copy is in every row alike). Writes
`<name>_<device>.{json,md}` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from benchmarks import report_files
from benchmarks.timing import median_ms
from moe_jax.kv_quant import OSKVPMode


def step_ms(mode: OSKVPMode, lengths: list[int], *, b: int, kh: int, g: int, h: int, cache_len: int,
            repeats: int, pre_steps: int = 0) -> tuple[float, int]:
  """(median ms, rows it refits) of one decode step on a cache prefilled to `lengths` (T = max(lengths)), after
  `pre_steps` untimed ones."""
  t = max(lengths)
  keys = jax.random.split(jax.random.key(0), 5)
  k, v = (jax.random.normal(kk, (b, t, kh, h), jnp.float32) for kk in keys[:2])
  cache = jax.jit(lambda k, v: mode.from_prefill(k, v, jnp.asarray(lengths), cache_len, layer=0))(k, v)
  q = jax.random.normal(keys[2], (b, 1, kh * g, h), jnp.float32)
  nk, nv = (jax.random.normal(kk, (b, 1, kh, h), jnp.float32) for kk in keys[3:])
  step = jax.jit(lambda c: c.extend(q, nk, nv, jnp.zeros(b, jnp.int32)))  # (attention output, cache)
  for _ in range(pre_steps):
    cache = step(cache)[1]
  refits = 0 if cache.refit is None else int(jnp.sum(cache.refit & (cache.n_res == cache.window)))
  return median_ms(lambda: step(cache), repeats), refits


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
  p.add_argument("--name", default="oskvp_refit_cost", help="results file stem")
  a = p.parse_args(argv)
  b, r = a.batch, a.window
  shape = dict(b=b, kh=a.kv_heads, g=a.group, h=a.head_dim, cache_len=a.cache_len, repeats=a.repeats)
  mode = OSKVPMode(window=r)
  long = r + r  # prefill n_comp = R: coded tokens already, so no refit flag; the window holds R tokens (flushes)
  # (name, mode, prompt lengths, untimed steps first): prompts shorter than R are flagged to refit; one untimed step
  # fills a window of R - 1 tokens, so the timed step flushes it (with its refit)
  cases = [
      ("no flush", mode, [r + 1] * b, 0),  # window holds 1 token after prefill
      ("all rows flush, prefill fit", mode, [long] * b, 0),
      ("all rows flush, refit off", dataclasses.replace(mode, refit_at_first_flush=False), [r - 1] * b, 1),
  ]
  for c in (int(x) for x in a.refit_chunks.split(",")):
    m = dataclasses.replace(mode, refit_chunk=c)
    cases += [(f"1 row flushes with a refit, chunk {c}", m, [r - 1] + [r - 2] * (b - 1), 1)]
    if b > 3:
      cases += [(f"3 rows flush with a refit, chunk {c}", m, [r - 1] * 3 + [r - 2] * (b - 3), 1)]
    cases += [(f"all {b} rows flush with a refit, chunk {c}", m, [r - 1] * b, 1)]
  rows = []
  for name, m, lengths, pre in cases:
    ms, refits = step_ms(m, lengths, pre_steps=pre, **shape)
    rows.append({"case": name, "ms": ms, "rows_refitted": refits})
  device = jax.devices()[0].device_kind
  result = {"shape": {k: v for k, v in shape.items() if k != "repeats"} | {"window": r}, "rows": rows}
  lines = [f"# OS-KVP refit at the first flush: one layer's decode step ({device}, jax {jax.__version__})", "",
           f"B={b}, K={a.kv_heads}, G={a.group}, H={a.head_dim}, R={r}, S={a.cache_len}; median of {a.repeats}.", "",
           "| case | rows refitted | ms |", "|---|---|---|"]
  lines += [f"| {x['case']} | {x['rows_refitted']} | {x['ms']:.3f} |" for x in rows]
  report_files.write(a.out, a.name, result, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
