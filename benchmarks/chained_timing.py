"""Timing a call as one jitted program of chained calls, by wall clock and by GPU span, and the copy bandwidth that
each clock's rates are divided by (shared by `decode_attention.py` and the benchmarks built on it).

A call's wall-clock ms is the median over runs of the chained program divided by its calls (`timeit`); its GPU span
is read from a profiler trace of the same program (`decode_timeline.trace_chained`). The copies are timed both ways
too, so that each clock's rate is divided by a copy timed with that clock (`copy_bandwidth`, `copy_bandwidth_span`).
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp

L2_BYTES = 60 * 2**20
# The copies, as op(x [n], c): x + 1 (float32, read + write), x * 2 (bfloat16, read + write) and a read-only sum; c
# is 0 for the wall-clock copies and a chained call's query element for the span copies. Bytes moved per element.
COPIES = ((lambda x, c: x + (1.0 + c), jnp.float32, 2 * 4),
          (lambda x, c: x * jnp.asarray(2.0 + c).astype(jnp.bfloat16), jnp.bfloat16, 2 * 2),
          (lambda x, c: jnp.sum(x) + c, jnp.float32, 4))


def chained_calls(fn, make_args, bytes_per_call, min_calls=8, own_args=False):
  """fn(*args) one call; make_args(i) -> args of copy i. Returns (multi, qs, arg_sets, calls): multi(qs, arg_sets)
  runs `calls` calls of fn in one jitted program, over enough copies of the arguments to defeat the L2 cache, or with
  `own_args` over one copy per call (calls = min_calls), so that no fusion can read an operand once for several calls.

  Call i's query carries a 1e-30 * (an element of call i-1's output): numerically a no-op, but it orders the calls
  and stops XLA from merging the calls' dots that share a K/V operand into one pass over the cache (the first
  version of this script lacked it, and XLA's rows there read the cache once for 8 calls).
  """
  copies = min_calls if own_args else max(1, min(16, math.ceil(3 * L2_BYTES / max(bytes_per_call, 1))))
  calls = max(min_calls, copies)
  arg_sets = [make_args(i) for i in range(copies)]
  qs = [jax.random.normal(jax.random.key(1000 + i), arg_sets[0][0].shape, jnp.float32).astype(arg_sets[0][0].dtype)
        for i in range(calls)]

  @jax.jit
  def multi(qs, arg_sets):
    outs, dep = [], jnp.float32(0)
    for i in range(calls):
      q = (qs[i].astype(jnp.float32) + dep).astype(qs[i].dtype)
      outs.append(fn(q, *arg_sets[i % copies][1:]))
      dep = outs[-1].reshape(-1)[0].astype(jnp.float32) * 1e-30
    return outs

  return multi, qs, arg_sets, calls


def timeit(fn, make_args, bytes_per_call, reps=15, min_calls=8, chained=None):
  """Wall-clock ms per call of fn (median over reps of `chained_calls`' program, divided by its calls); `chained`:
  that program, already built."""
  multi, qs, arg_sets, calls = chained or chained_calls(fn, make_args, bytes_per_call, min_calls)
  jax.block_until_ready(multi(qs, arg_sets))
  jax.block_until_ready(multi(qs, arg_sets))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(multi(qs, arg_sets))
    times.append((time.perf_counter() - t0) * 1e3 / calls)
  del arg_sets
  return statistics.median(times)


def copy_bandwidth():
  """(copy TB/s counting read + write: the better of f32 x+1 and bf16 x*2 on 4 GiB, read-only sum TB/s).

  One call per host sync, so the launch and sync overhead counts against each pass: on 1 GiB (the first sessions'
  size) that made these rates 2.7-3.1 TB/s while cuDNN read at 4.4 TB/s in the same runs; on 4 GiB they are still
  ~10% under `copy_bandwidth_span` (3.78 against 4.20 TB/s, results/decode_attention_mosaic_s24.md). The wall-clock
  rates' denominator; the minimum over 20 passes is kept.
  """
  x = jax.random.normal(jax.random.key(0), (2**30,), jnp.float32)
  res = []
  for op, dtype, moved in COPIES:
    arr = x.astype(dtype).reshape(-1, 2**29) if dtype == jnp.bfloat16 else x
    f = jax.jit(lambda x, op=op: op(x, 0.0))
    jax.block_until_ready(f(arr))
    ts = []
    for _ in range(20):
      t0 = time.perf_counter()
      jax.block_until_ready(f(arr))
      ts.append(time.perf_counter() - t0)
    res.append(moved * arr.size / min(ts) / 1e12)
  return max(res[0], res[1]), res[2]


def copy_bandwidth_span(reps: int = 3, n: int = 2**26, calls: int = 8):
  """The same copies timed by GPU span, the clock of `decode_attention.py --span`'s rows: (copy TB/s, read-only sum
  TB/s), each the best of `reps` profiler traces (`decode_timeline.trace_chained`) of `chained_calls`' program with
  `own_args` (`calls` calls, each on its own n-element array), or (None, None) where the trace has no GPU kernels
  (CPU). The span rates' denominator: `copy_bandwidth` pays host launch and sync, so a span rate over it overstates
  the fraction of copy bandwidth.
  """
  from benchmarks.decode_timeline import trace_chained  # pylint: disable=g-import-not-at-top
  rates = []
  for op, dtype, moved in COPIES:
    make_args = lambda i, dtype=dtype: (jnp.zeros((1,), jnp.float32),
                                        jax.random.normal(jax.random.key(i), (n,), jnp.float32).astype(dtype))
    chained = chained_calls(lambda q, x, op=op: op(x, q[0]), make_args, moved * n, min_calls=calls, own_args=True)
    spans = [trace_chained(chained).get("span_us") for _ in range(reps)]
    del chained
    rates.append(None if None in spans else moved * n / min(spans) / 1e6)
  if None in rates:
    return None, None
  return max(rates[0], rates[1]), rates[2]
