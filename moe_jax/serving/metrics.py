"""Latency, throughput and occupancy of a serving run, from the request handles and the engine's counters.

TTFT = first token time - submit time; per-token latency = the gaps between a request's consecutive tokens
(the first token excluded); throughput = generated tokens / wall time; occupancy = active slots / slots per decode
step; KV bytes in use = cached positions of active slots × allocated bytes per position.
"""

from __future__ import annotations

import numpy as np


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
  """{"p50": ..., "p90": ..., "p99": ..., "mean": ...} in the values' unit (NaN when empty)."""
  v = np.asarray(values, np.float64)
  if v.size == 0:
    return {**{f"p{q}": float("nan") for q in qs}, "mean": float("nan")}
  return {**{f"p{q}": float(np.percentile(v, q)) for q in qs}, "mean": float(v.mean())}


def summarize(handles, engine, wall_s: float) -> dict:
  """Metrics of a finished run.

  Args:
    handles: the runs' `RequestHandle`s (ended).
    engine: the `Engine` that served them (its `stats` cover this run only if it was fresh or reset).
    wall_s: seconds from the first submit to the last token.
  """
  ttft = [(h.first_token_time - h.submit_time) * 1e3 for h in handles if h.first_token_time is not None]
  gaps = [d * 1e3 for h in handles for d in np.diff(h.token_times)]
  n_tokens = sum(len(h.tokens) for h in handles)
  st, c = engine.stats, engine.config
  active = np.asarray(st.active_per_step, np.float64)
  positions = np.asarray(st.positions_per_step, np.float64)
  per_pos = engine.kv_bytes_total / (c.num_slots * c.cache_len)
  statuses = {}
  for h in handles:
    statuses[h.status] = statuses.get(h.status, 0) + 1
  return {
      "requests": len(handles),
      "statuses": statuses,
      "generated_tokens": n_tokens,
      "wall_s": wall_s,
      "throughput_tokens_per_s": n_tokens / wall_s if wall_s > 0 else float("nan"),
      "requests_per_s": len(handles) / wall_s if wall_s > 0 else float("nan"),
      "ttft_ms": percentiles(ttft),
      "per_token_latency_ms": percentiles(gaps),
      "decode_step_ms": percentiles(np.asarray(st.step_seconds) * 1e3),
      "decode_steps": st.decode_steps,
      "prefill_calls": st.prefill_calls,
      "slots": c.num_slots,
      "slot_occupancy_mean": float(active.mean() / c.num_slots) if active.size else 0.0,
      "slot_occupancy_peak": float(active.max() / c.num_slots) if active.size else 0.0,
      "kv_bytes_allocated": int(engine.kv_bytes_total),
      "kv_bytes_in_use_mean": float(positions.mean() * per_pos) if positions.size else 0.0,
      "kv_bytes_in_use_peak": float(positions.max() * per_pos) if positions.size else 0.0,
  }


def json_safe(obj):
  """`obj` with every non-finite float (NaN percentiles of an empty sample) as None, for strict JSON."""
  if isinstance(obj, dict):
    return {k: json_safe(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [json_safe(v) for v in obj]
  if isinstance(obj, (float, np.floating)) and not np.isfinite(obj):
    return None
  return obj


def markdown(summary: dict, title: str = "Serving benchmark") -> str:
  """A short report of `summarize`'s output."""
  s = summary
  lat = lambda d: f"{d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f}"  # noqa: E731
  rows = [
      ("requests (statuses)", f"{s['requests']} ({', '.join(f'{k}: {v}' for k, v in sorted(s['statuses'].items()))})"),
      ("generated tokens", f"{s['generated_tokens']:,}"),
      ("wall time", f"{s['wall_s']:.2f} s"),
      ("throughput", f"{s['throughput_tokens_per_s']:,.1f} tokens/s, {s['requests_per_s']:.2f} requests/s"),
      ("TTFT p50 / p90 / p99", f"{lat(s['ttft_ms'])} ms"),
      ("per-token latency p50 / p90 / p99", f"{lat(s['per_token_latency_ms'])} ms"),
      ("decode step p50 / p90 / p99", f"{lat(s['decode_step_ms'])} ms ({s['decode_steps']} steps, "
                                      f"{s['prefill_calls']} prefill calls)"),
      ("slot occupancy mean / peak", f"{s['slot_occupancy_mean']:.0%} / {s['slot_occupancy_peak']:.0%} of "
                                     f"{s['slots']} slots"),
      ("KV bytes in use mean / peak / allocated", f"{s['kv_bytes_in_use_mean']:,.0f} / "
                                                  f"{s['kv_bytes_in_use_peak']:,.0f} / {s['kv_bytes_allocated']:,}"),
  ]
  lines = [f"# {title}", "", "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
  return "\n".join(lines) + "\n"
