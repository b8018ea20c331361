"""Expert-parallel decode across mesh layouts, with exact routing and with LCVC + surrogates; quality sweeps.

    python -m sharding.experiments --config=tiny-trained --layouts=1x8,2x4,4x2,8x1 --out=DIR

`--config` is a preset of `configs/` (random weights) or a checkpoint (`moe_jax.checkpoints.load`). On CPU the
module asks XLA for 8 simulated devices when JAX_PLATFORMS=cpu and XLA_FLAGS does not say otherwise.

For each layout N×L (nodes × devices per node) and routing ("exact", "lcvc"):
  * step_ms: median wall time of the sharded, jitted decode step (batch `--batch`, after a prefill of
    `--prompt_len` tokens), over `--steps` steps after one warm-up;
  * node_axis_bytes_per_step: bytes the compiled decode step's collectives move between devices of different nodes,
    summed over devices, read from the compiled HLO (`sharding/hlo_collectives.py`); padded buffers count whole;
  * node_axis_payload_bytes_per_step: what the routed pairs need (remote pairs × D × bytes × 2 × MoE layers), the
    bytes a ragged transport would move;
  * remote_rate, surrogate_rate: fraction of chosen (token, expert) pairs whose expert is on another node, and of
    pairs computed by a surrogate, on the validation windows;
  * bpb_delta, kl: bits per byte minus exact routing's, and KL(exact ‖ variant) in nats per position, through
    prefill + teacher-forced decode as `moe_jax.eval` measures them (surrogates serve decode steps only);
  * max_abs_err: |sharded decode step − the same model's single-device decode step| (correctness check).
For each layout and routing, bytes_per_device: the most and the fewest bytes a device holds of the sharded model's
state, all of it and its routed experts alone (`sharding/memory.py`, read from the placed arrays); beside the totals
expert_bytes_total and surrogate_bytes_per_device.
Then a sweep over nodes × λ × rank on one device (routing and surrogates do not depend on the device count).
Writes DIR/experiments.{md,json,png}.
"""

from __future__ import annotations

import os

from sharding import cpu_devices

if os.environ.get("JAX_PLATFORMS", "") == "cpu" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = cpu_devices.with_device_count(os.environ.get("XLA_FLAGS", ""), 8)

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import configs
from moe_jax import data as data_lib
from moe_jax import decode, locality
from moe_jax import eval as eval_lib
from jax.sharding import PartitionSpec as P

from moe_jax import surrogates as surrogates_lib
from moe_jax.serving.metrics import json_safe
from sharding import experiment_flags, hlo_collectives, memory, meshes, rules, runner

ROW_KEYS = ["layout", "routing", "transport", "step_ms", "node_axis_bytes_per_step", "node_axis_payload_bytes_per_step",
            "remote_rate", "surrogate_rate", "bpb_delta", "kl", "max_abs_err"]


def load_model(name: str):
  """A checkpoint (shipped name or directory) or else a preset (random weights, seed 0) -> (config, model, trained).

  A checkpoint wins over a preset of the same name ("tiny-trained" is both: the shape and the trained weights).
  """
  from moe_jax import checkpoints
  try:
    checkpoints.resolve(name)
  except ValueError:
    config = configs.get(name)
    return config, decode.init_model(config, seed=0), False
  config, model = checkpoints.load(name)
  return config, model, True


def token_data(config, *, n_windows: int, context: int, n_calib: int, calib_len: int, seed: int = 0):
  """(validation windows int32 [W, context + 1], calibration batches [n_calib, 8, calib_len]) from the corpus."""
  if config.vocab_size < 259:
    raise ValueError(f"config {config.name!r} has vocab_size={config.vocab_size}; the corpus is byte-level")
  corpus = data_lib.load_corpus()
  windows = data_lib.eval_windows(corpus["validation"].tokens, n_windows=n_windows, seq_len=context)
  calib = np.stack([data_lib.train_batch(corpus["train"].tokens, 10_000 + i, batch_size=8, seq_len=calib_len - 1,
                                         seed=seed) for i in range(n_calib)])
  return windows, calib


class Quality:
  """Teacher-forced decode quality against exact routing, the baseline computed once."""

  def __init__(self, model, windows: np.ndarray, prefix: int):
    self.windows, self.prefix = jnp.asarray(windows), prefix
    self.targets = windows[:, prefix:]
    self.cache_len = windows.shape[1] - 1  # the model is fed all but a window's last token (as `moe_jax.eval`)
    if self.cache_len > model.config.max_seq_len:  # inside the jit the prefill's checks cannot see it
      raise ValueError(f"windows of {windows.shape[1]} tokens need {self.cache_len} positions, past the model's "
                       f"max_seq_len={model.config.max_seq_len}")
    self.base = self._logp(model)
    self.base_bpb = eval_lib.bits_per_byte(self.base, self.targets)

  def _logp(self, model) -> np.ndarray:
    logp, _ = eval_lib.teacher_forced_logprobs(
        model, self.windows, prefix=self.prefix, kv_cache="fp32", cache_len=self.cache_len)
    return np.asarray(logp)

  def __call__(self, variant) -> dict:
    logp = self._logp(variant)
    p = np.exp(self.base)
    return {"bpb": eval_lib.bits_per_byte(logp, self.targets),
            "bpb_delta": eval_lib.bits_per_byte(logp, self.targets) - self.base_bpb,
            "kl": float(np.mean(np.sum(p * (self.base - logp), axis=-1))),
            "agreement": float(np.mean(np.argmax(logp, -1) == np.argmax(self.base, -1)))}


def lcvc_model(model, n_nodes: int, *, penalty: float, rank: int, target: float, calib: np.ndarray, whiten: bool,
               tune_rounds: int):
  """LCVC over `n_nodes` with rank-`rank` surrogates (0: exact remote experts), τ tuned online on `calib`."""
  cfg = locality.LCVCConfig(n_nodes=n_nodes, penalty=penalty, threshold=0.5, target_remote_rate=target,
                            threshold_step=0.05, surrogates=rank > 0)
  calib_tokens = jnp.asarray(calib.reshape(-1, calib.shape[-1])[:16]) if whiten else None
  m = locality.make_lcvc(model, cfg, rank=rank, calibration_tokens=calib_tokens)
  retune(m, calib, tune_rounds)
  return m


def retune(model, calib: np.ndarray, rounds: int) -> list[float]:
  batches = [calib[i % len(calib)] for i in range(rounds)]
  return locality.tune_thresholds(model, batches)


def remote_rate(model, windows: np.ndarray) -> float:
  return float(jnp.mean(locality.routing_stats(model, jnp.asarray(windows[:, :-1]))["remote_rate"]))


def decode_benchmark(model, mesh, *, surrogate: bool, transport: str, batch: int, prompt_len: int, steps: int,
                     seed: int = 0) -> dict:
  """Times the sharded decode step and reads its collectives. model: plain or LCVC (surrogates when `surrogate`)."""
  sm = runner.shard(model, mesh, surrogate_decode=surrogate, transport=transport)
  tokens = jax.random.randint(jax.random.key(seed), (batch, prompt_len), 0, 256)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  cache_len = prompt_len + steps + 2
  _, cache = sm.prefill(tokens, lengths, kv_cache="fp32", cache_len=cache_len)
  nxt = jax.random.randint(jax.random.key(seed + 1), (batch,), 0, 256)
  hlo = sm.decode_hlo(cache, nxt)
  timed = sm.decode_fn(cache, donate=True)  # the loop updates its cache in place, as a serving loop would
  state = sm.state
  nxt_sharded = sm.put(nxt, P(rules.RULES[sm.layout]["batch"]))
  got, c = timed(state, cache, nxt_sharded)  # warm-up (compiles), and the first step checked below; consumes cache
  jax.block_until_ready(got)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    logits, c = timed(state, c, nxt_sharded)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
  # Correctness: the first sharded step against the single-device model's.
  ref_model = locality.set_surrogates(model, False) if surrogate else model
  _, ref_cache = decode.prefill(ref_model, tokens, lengths, kv_cache="fp32", cache_len=cache_len)
  ref_step, _ = decode.decode_step(locality.set_surrogates(model, True) if surrogate else model, ref_cache, nxt)
  summary = hlo_collectives.summarize(hlo, meshes.device_nodes(mesh))
  return {"step_ms": 1e3 * float(np.median(times)), "node_axis_bytes_per_step": float(summary["cross_node_bytes"]),
          "all_device_bytes_per_step": float(summary["total_bytes"]), "collectives": summary["n_collectives"],
          "cross_node_collectives": summary["n_cross_node"],
          "max_abs_err": float(jnp.max(jnp.abs(jnp.asarray(got) - ref_step)))}


def device_bytes(model, mesh) -> dict[str, int]:
  """`memory.summary` of `model` placed on `mesh` by `runner.shard` (layout "ep"): the most and fewest bytes a device
  holds, of the whole state and of the routed experts alone."""
  return memory.summary(runner.shard(model, mesh).state)


def payload_bytes(config, rate: float, batch: int) -> float:
  n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
  return rate * batch * config.n_experts_per_tok * config.d_model * 4 * 2 * n_moe


def run(f) -> dict:
  layouts = experiment_flags.check_flags(f, n_devices=jax.device_count())
  config, model, trained = load_model(f.config)
  experiment_flags.check_expert_nodes(f, layouts, config.n_experts)
  experiment_flags.check_model_limits(f, config.max_seq_len)
  windows, calib = token_data(config, n_windows=f.windows, context=f.context, n_calib=4, calib_len=f.context)
  quality = Quality(model, windows, f.prefix)
  rows, sweep, bytes_rows = [], [], []
  t_start = time.time()
  for n, l in layouts:
    mesh = meshes.simulated_mesh(n, l)
    layout = f"{n}x{l}"
    exact_rate = remote_rate(locality.with_lcvc(model, locality.LCVCConfig(n_nodes=n, penalty=0.0)), windows)
    lcvc = lcvc_model(model, n, penalty=f.penalty, rank=f.rank, target=f.target_remote_rate, calib=calib,
                      whiten=f.whiten, tune_rounds=f.tune_rounds)
    lcvc_rate = remote_rate(lcvc, windows)
    q_lcvc = quality(lcvc)
    for routing, m in (("exact", model), ("lcvc", lcvc)):
      try:
        bytes_rows.append({"layout": layout, "routing": routing, **device_bytes(m, mesh)})
      except Exception as e:  # pylint: disable=broad-except
        bytes_rows.append({"layout": layout, "routing": routing, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    for transport in f.transports.split(","):
      for routing, m, surrogate, rate, q in (("exact", model, False, exact_rate, None),
                                             ("lcvc", lcvc, True, lcvc_rate, q_lcvc)):
        try:
          bench = decode_benchmark(m, mesh, surrogate=surrogate, transport=transport, batch=f.batch,
                                   prompt_len=f.prompt_len, steps=f.steps)
        except Exception as e:  # pylint: disable=broad-except
          # A transport the backend lacks (ragged on CPU) is recorded, not fatal to the other rows.
          bench = {"step_ms": float("nan"), "node_axis_bytes_per_step": float("nan"), "max_abs_err": float("nan"),
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row = {"layout": layout, "routing": routing, "transport": transport, **bench, "remote_rate": rate,
               "surrogate_rate": rate if surrogate else 0.0,
               "node_axis_payload_bytes_per_step": 0.0 if surrogate else payload_bytes(config, rate, f.batch),
               "bpb_delta": q["bpb_delta"] if q else 0.0, "kl": q["kl"] if q else 0.0,
               "agreement": q["agreement"] if q else 1.0}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ROW_KEYS}), flush=True)
  # Quality sweep: nodes × rank × λ (one device: routing and surrogates do not depend on the mesh).
  for n in sorted({n for n, _ in layouts if n > 1}):
    for rank in [int(r) for r in f.ranks.split(",")]:
      m = lcvc_model(model, n, penalty=0.0, rank=rank, target=f.target_remote_rate, calib=calib, whiten=f.whiten,
                     tune_rounds=0)
      for lam in [float(v) for v in f.lambdas.split(",")]:
        locality.set_penalty(m, lam, threshold=0.5)
        retune(m, calib, f.tune_rounds if lam > 0 else 0)
        rate = remote_rate(m, windows)
        q = quality(m)
        taus = [float(layer.threshold[...]) for layer in locality.moe_layers(m)]
        sweep.append({"nodes": n, "rank": rank, "penalty": lam, "remote_rate": rate,
                      "surrogate_rate": rate if rank else 0.0, "tau": taus, **q})
        print(json.dumps(sweep[-1]), flush=True)
  sur_bytes = {}
  for rank in sorted({f.rank, *[int(r) for r in f.ranks.split(",")]} - {0}):
    per_replica = sum(s.nbytes() for s in surrogates_lib.build_surrogates(model, rank))
    sur_bytes[rank] = per_replica
  return {
      "config": f.config, "trained": trained, "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
      "n_devices": jax.device_count(), "jax": jax.__version__, "python": platform.python_version(),
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "settings": {k: getattr(f, k) for k in ("batch", "prompt_len", "steps", "penalty", "rank", "whiten",
                                              "target_remote_rate", "tune_rounds", "windows", "context", "prefix",
                                              "lambdas", "ranks", "transports")},
      "model": {"d_model": config.d_model, "n_layers": config.n_layers, "n_experts": config.n_experts,
                "k": config.n_experts_per_tok, "expert_hidden": config.expert_hidden, "dtype": config.param_dtype},
      "baseline_bpb": quality.base_bpb,
      "surrogate_bytes_per_device": sur_bytes,
      "expert_bytes_total": sum(int(v.nbytes) for layer in locality.moe_layers(model)
                                for v in (layer.w_gate[...], layer.w_up[...], layer.w_down[...])),
      "bytes_per_device": bytes_rows,
      "rows": rows, "sweep": sweep, "seconds": time.time() - t_start,
  }


def markdown(res: dict) -> str:
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  s = res["settings"]
  lines = [
      f"# Expert-parallel decode: exact routing vs LCVC + surrogates ({res['config']})", "",
      f"{res['date']}; {res['n_devices']} × {res['device']} ({res['platform']}); jax {res['jax']}; model "
      f"{res['model']}; batch {s['batch']}, prompt {s['prompt_len']}, {s['steps']} timed decode steps; LCVC λ = "
      f"{s['penalty']}, τ tuned toward remote rate {s['target_remote_rate']} ({s['tune_rounds']} online rounds), "
      f"surrogate rank {s['rank']} ({'activation-whitened' if s['whiten'] else 'plain SVD'}). Quality: "
      f"{s['windows']} validation windows, prefill {s['prefix']} + teacher-forced decode to {s['context']}; "
      f"exact-routing baseline {res['baseline_bpb']:.4f} bits/byte.", "",
      "| " + " | ".join(ROW_KEYS) + " |", "|" + "---|" * len(ROW_KEYS)]
  for r in res["rows"]:
    lines.append("| " + " | ".join(fmt(r[k]) for k in ROW_KEYS) + " |")
  errors = [f"- {r['layout']} {r['routing']} {r['transport']}: {r['error']}" for r in res["rows"] if r.get("error")]
  if errors:
    lines += ["", "Rows that did not run:", *errors]
  lines += ["", "Surrogate memory per device (replicated on every device, so per node = devices per node × this): "
            + ", ".join(f"rank {r}: {b / 1e6:.3f} MB" for r, b in res["surrogate_bytes_per_device"].items())
            + f"; all routed experts: {res['expert_bytes_total'] / 1e6:.3f} MB.", ""]
  if res.get("bytes_per_device"):  # (results written before it was measured have none)
    lines += ["Bytes each device holds of the sharded model, max / min over devices (experts: the routed experts "
              "alone; `sharding/memory.py`):", "",
              "| layout | routing | state max | state min | experts max | experts min |", "|---|---|---|---|---|---|"]
    for r in res["bytes_per_device"]:
      if "error" in r:
        lines.append(f"| {r['layout']} | {r['routing']} | {r['error']} | | | |")
        continue
      mb = [f"{r[f'{k}_bytes_per_device_{m}'] / 1e6:.3f} MB" for k in ("state", "expert") for m in ("max", "min")]
      lines.append(f"| {r['layout']} | {r['routing']} | " + " | ".join(mb) + " |")
    lines.append("")
  lines += ["## Quality sweep (one device): nodes × surrogate rank (0 = remote experts exact) × λ", "",
            "| nodes | rank | λ | remote_rate | surrogate_rate | bpb_delta | kl | agreement | τ per layer |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in res["sweep"]:
    lines.append(f"| {r['nodes']} | {r['rank']} | {r['penalty']} | {r['remote_rate']:.4f} | "
                 f"{r['surrogate_rate']:.4f} | {r['bpb_delta']:+.4f} | {r['kl']:.4f} | {r['agreement']:.4f} | "
                 f"{', '.join(f'{t:.2f}' for t in r['tau'])} |")
  return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  layouts = sorted({r["layout"] for r in res["rows"]}, key=lambda s: int(s.split("x")[0]))
  transport = res["rows"][0]["transport"]
  x = np.arange(len(layouts))
  for i, routing in enumerate(("exact", "lcvc")):
    rs = {r["layout"]: r for r in res["rows"] if r["routing"] == routing and r["transport"] == transport}
    axes[0].bar(x + 0.4 * i, [rs[lay]["step_ms"] for lay in layouts], 0.4, label=routing)
    axes[1].bar(x + 0.4 * i, [rs[lay]["node_axis_bytes_per_step"] / 1e3 for lay in layouts], 0.4, label=routing)
  for ax, title in zip(axes[:2], ("decode step (ms)", "bytes across nodes per decode step (kB, from HLO)")):
    ax.set_xticks(x + 0.2, layouts)
    ax.set_xlabel("layout (nodes x devices per node)")
    ax.set_title(title)
    ax.legend()
  for (n, rank), group in _groups(res["sweep"]).items():
    axes[2].plot([r["remote_rate"] for r in group], [r["bpb_delta"] for r in group], "o-",
                 label=f"{n} nodes, rank {rank}")
  axes[2].set_xlabel("remote rate")
  axes[2].set_ylabel("bits/byte increase over exact routing")
  axes[2].set_title("quality (λ sweep)")
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _groups(sweep):
  out = {}
  for r in sweep:
    out.setdefault((r["nodes"], r["rank"]), []).append(r)
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  jax.config.update("jax_default_matmul_precision", "highest")
  os.makedirs(f.out, exist_ok=True)  # an unusable --out fails now, not after the sweep
  res = run(f)
  with open(os.path.join(f.out, "experiments.json"), "w") as fh:
    json.dump(json_safe(res), fh, indent=2)  # strict JSON: a row that did not run has null, not NaN
  with open(os.path.join(f.out, "experiments.md"), "w") as fh:
    fh.write(markdown(res))
  plot(res, os.path.join(f.out, "experiments.png"))
  print(markdown(res))


if __name__ == "__main__":
  flags.DEFINE_string("config", "tiny-trained", "Preset (random weights) or checkpoint name/directory.")
  flags.DEFINE_string("layouts", "1x8,2x4,4x2,8x1", "Comma-separated NxL mesh layouts.")
  flags.DEFINE_string("out", "benchmarks/results/sharding", "Output directory.")
  flags.DEFINE_string("transports", "padded", "Expert-parallel transports: padded, ragged (GPU), ragged_emulated.")
  flags.DEFINE_integer("batch", 16, "Decode batch (divisible by the devices).")
  flags.DEFINE_integer("prompt_len", 32, "Prefill length before the timed decode steps.")
  flags.DEFINE_integer("steps", 20, "Timed decode steps.")
  flags.DEFINE_float("penalty", 1.0, "LCVC λ of the layout rows.")
  flags.DEFINE_integer("rank", 16, "Surrogate rank of the layout rows.")
  flags.DEFINE_bool("whiten", True, "Activation-whitened surrogates (calibration on training windows).")
  flags.DEFINE_float("target_remote_rate", 0.1, "Target of τ's online tuning.")
  flags.DEFINE_integer("tune_rounds", 8, "Online τ updates (one per calibration batch).")
  flags.DEFINE_integer("windows", 16, "Validation windows for quality.")
  flags.DEFINE_integer("context", 128, "Tokens per validation window.")
  flags.DEFINE_integer("prefix", 32, "Prefilled tokens per window before teacher-forced decode.")
  flags.DEFINE_string("lambdas", "0,0.05,0.2,1", "λ values of the quality sweep.")
  flags.DEFINE_string("ranks", "0,8,32", "Surrogate ranks of the quality sweep (0: remote experts exact).")
  app.run(main)
