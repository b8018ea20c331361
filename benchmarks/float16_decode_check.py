"""param_dtype="float16" through prefill and decode on the GPU, every KV cache mode, against the float32 model.

Run on the GPU:  PYTHONPATH=$PWD python3 benchmarks/float16_decode_check.py [--out=DIR]
Two models: `tiny-trained` (head dim 32) loaded in float32 and in float16, and a random head-dim-128 model (8 query /
2 kv heads: the shape at which `oskvp_uniform` takes the Mosaic GPU core) whose float16 copy holds the float32
weights rounded. For each KV cache mode it runs a ragged prefill and `--steps` decode steps with both models (the
cache's default implementation: the Pallas kernels on the GPU) and records the largest |logit difference| / max
|logit| per step, the next-token agreement and whether any logit is not finite. The CPU suite checks the same on the
CPU (`tests/moe_jax/test_decode.py`, fp32 and bf16 caches); this is the GPU's run of it. Exits 1 if a mode fails,
gives non-finite logits, or its median step exceeds `--limit`.
--trace_routing also counts, per step, the (layer, token) expert choices in which the float16 model differs from the
float32 one, and reruns the float16 model with the float32 model's choices (`RoutingTrace`): on the CPU every jump
of a single step came with such flips and went away with float32's routing (README, float16). Make no decode call
before it: the trace must be in place when the programs compile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

import configs
from moe_jax import checkpoints, decode, routing
from moe_jax.kv_cache import KV_CACHE_MODES
import moe_jax.kv_quant  # noqa: F401  (registers the quantized modes)

MODES = ("fp32", "bf16", "fp8", "int8", "kivi2", "oskvp", "oskvp3", "oskvp_k3v2", "oskvp_k3v2_sym", "oskvp_sym",
         "oskvp_uniform")


def as_float16(model32, cfg):
  """A float16 model holding model32's parameters rounded to float16."""
  model16 = decode.init_model(dataclasses.replace(cfg, param_dtype="float16"), seed=0)
  nnx.update(model16, jax.tree.map(lambda a: a.astype(jnp.float16), nnx.state(model32, nnx.Param)))
  return model16


class RoutingTrace:
  """Records the experts every MoE layer chooses (`routing.select_experts`' ids, in program order, through an
  ordered `io_callback`) while active: `with trace: ...` then `trace.calls`, a list of int32 [T, X] arrays. With
  `trace.replay(calls)`, the next active run takes those choices instead of its own (in the same order; the combine
  weights are its own affinities at the replayed experts), so a difference that remains is not routing's.
  Make it before the first prefill or decode step: programs compiled earlier do not call it (`routing_flips` then
  sees no calls and says so)."""

  def __init__(self):
    self.calls, self.active, self._replay = [], False, None
    self._select = routing.select_experts

    def select(logits, *, k, router="softmax", norm_topk_prob=True, selection_bias=None):
      weights, ids = self._select(logits, k=k, router=router, norm_topk_prob=norm_topk_prob,
                                  selection_bias=selection_bias)
      ids = io_callback(self._take, jax.ShapeDtypeStruct(ids.shape, ids.dtype), ids, ordered=True)
      return routing.combine_weights(routing.affinities(logits, router), ids, norm_topk_prob), ids

    routing.select_experts = select  # every trace after this records (decode steps compile once, both models)

  def _take(self, ids):
    ids = np.asarray(ids)
    if self.active and self._replay is not None:
      ids = self._replay[len(self.calls)]
    if self.active:
      self.calls.append(ids)
    return ids

  def uninstall(self) -> None:
    """Puts `routing.select_experts` back (programs traced meanwhile keep the callback: clear jax's caches)."""
    routing.select_experts = self._select

  def replay(self, calls: list) -> "RoutingTrace":
    self._replay = calls
    return self

  def __enter__(self):
    self.calls, self.active = [], True
    return self

  def __exit__(self, *exc):
    self.active, self._replay = False, None


def routing_flips(calls_a: list, calls_b: list, n_layers: int, steps: int) -> list[int]:
  """Per step (0: the prefill), how many (layer, token) choices differ between two runs' traces as sets of experts."""
  if len(calls_a) != len(calls_b) or len(calls_a) != n_layers * (steps + 1):
    hint = (" (none recorded: were the programs compiled before the RoutingTrace was made?)"
            if not calls_a or not calls_b else "")
    raise ValueError(f"traces of {len(calls_a)} and {len(calls_b)} calls, expected {n_layers * (steps + 1)}{hint}")
  flips = []
  for s in range(steps + 1):
    pairs = zip(calls_a[s * n_layers:(s + 1) * n_layers], calls_b[s * n_layers:(s + 1) * n_layers])
    flips.append(int(sum(np.sum(np.any(np.sort(a, -1) != np.sort(b, -1), axis=-1)) for a, b in pairs)))
  return flips


def compare(name, model32, model16, vocab, steps, t, cache_len, modes=MODES, trace=None) -> list[dict]:
  """Runs every mode with both models; with a `RoutingTrace`, each row also counts routing flips per step."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (3, t + steps)).astype(np.int32)
  lengths = np.array([t, t - t // 4, t // 3], np.int32)
  rows = []
  for mode in modes:
    if mode not in KV_CACHE_MODES:
      continue
    def run(model, context):
      """Prefill and `steps` decode steps under `context` (a trace, a replay or nothing) -> logits [steps + 1, 3, V]."""
      with context:
        logits, cache = decode.prefill(model, tokens[:, :t], lengths, kv_cache=mode, cache_len=cache_len,
                                       last_only=True)
        got = [np.asarray(logits, np.float32)]
        pos = lengths.copy()
        for _ in range(steps):
          logits, cache = decode.decode_step(model, cache, tokens[np.arange(3), np.minimum(pos, t + steps - 1)])
          got.append(np.asarray(logits, np.float32))
          pos += 1
        jax.effects_barrier()
      return np.stack(got)

    try:
      outs, traces = [], []
      for model in (model32, model16):
        outs.append(run(model, trace if trace is not None else contextlib.nullcontext()))
        traces.append(trace.calls if trace is not None else None)
      if trace is not None:  # the float16 model again, with the float32 model's expert choices
        replayed = run(model16, trace.replay(traces[0]))
      a, b = outs
      scale = np.abs(a).max(axis=(1, 2))
      rel = np.abs(b - a).max(axis=(1, 2)) / scale
      row = dict(model=name, kv_cache=mode, worst_rel=float(rel.max()), finite=bool(np.isfinite(b).all()),
                 agreement=float((a.argmax(-1) == b.argmax(-1)).mean()),
                 rel_by_step=[round(float(x), 5) for x in rel])  # step 0: the prefill's logits
      if trace is not None:
        n_moe = sum(model32.config.is_moe_layer(i) for i in range(model32.config.n_layers))
        row["routing_flips_by_step"] = routing_flips(*traces, n_moe, steps)
        row["rel_by_step_float32_routing"] = [
            round(float(x), 5) for x in np.abs(replayed - a).max(axis=(1, 2)) / scale]
      rows.append(row)
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(model=name, kv_cache=mode, error=repr(e)[:400]))
    print(rows[-1], flush=True)
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--limit", type=float, default=0.05, help="largest median step (relative logit difference) allowed")
  ap.add_argument("--out", default=None)
  ap.add_argument("--modes", default=",".join(MODES), help="comma-separated KV cache modes")
  ap.add_argument("--models", default="tiny-trained,random", help="tiny-trained and/or random (head dim 128)")
  ap.add_argument("--trace_routing", action="store_true",
                  help="also count, per step, the (layer, token) expert choices that differ between the models")
  args = ap.parse_args(argv)
  trace = RoutingTrace() if args.trace_routing else None
  print("backend", jax.default_backend(), jax.devices()[0].device_kind, flush=True)
  modes, models, rows = args.modes.split(","), args.models.split(","), []
  if "tiny-trained" in models:
    cfg32, m32 = checkpoints.load("tiny-trained")
    _, m16 = checkpoints.load("tiny-trained", param_dtype="float16")
    rows += compare("tiny-trained (H=32)", m32, m16, cfg32.vocab_size, args.steps, 200, 512, modes, trace)
  if "random" in models:
    cfg = dataclasses.replace(configs.get("tiny"), d_model=256, n_heads=8, n_kv_heads=2, head_dim=128)
    wide = decode.init_model(cfg, seed=0)
    rows += compare("random (H=128)", wide, as_float16(wide, cfg), cfg.vocab_size, args.steps, 300, 1024, modes,
                    trace)
  # The median over steps: a single step can jump (tiny-trained, random tokens: 0.08 at the eighth step with the fp32
  # cache on the CPU, where the others are ~1e-3), as a near-tie between experts or tokens resolves differently.
  bad = [r for r in rows if "error" in r or not r["finite"] or float(np.median(r["rel_by_step"])) > args.limit]
  print(f"{len(rows) - len(bad)} of {len(rows)} with a median step within {args.limit}", flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "float16_decode_check.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
