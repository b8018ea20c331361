"""Training: AdamW + warmup/cosine, router z-loss and switch load balancing, one jitted step, orbax checkpoints.

`python -m moe_jax.train --config=NAME --workdir=DIR [--steps=N]` trains on the stdlib corpus (`moe_jax.data`),
saves an orbax checkpoint every `--save_every` steps (keeping the last `--keep`, written asynchronously), appends
metrics as JSON lines to `DIR/metrics.jsonl`, and resumes from the latest checkpoint of DIR when there is one. The
batch of step s is a pure function of (seed, s), so the loader's state is the step and a resumed run continues the
loss curve exactly. `--export=DIR2` writes the compact shipped format (`moe_jax.checkpoints.export`) at the end.

The train state is a pytree: {"params": nnx.State of Params, "rest": the other variables (the MoE router biases),
"opt_state": optax state, "step": int32}. The router bias (`moe.RouterBias`) is not a Param: with
`bias_update_rate > 0` it follows the auxiliary-loss-free rule of DeepSeek-V3, outside the gradient:
bias_e += rate · sign(mean_count − count_e) after every step.

With more than one device the batch is sharded over a 1-D ("data",) mesh and the state replicated (data parallel);
XLA inserts the gradient all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_jax import checkpoints
from moe_jax import data as data_lib
from moe_jax.config import ModelConfig
from moe_jax.decode import init_model
from moe_jax.model import Transformer

LN2 = float(np.log(2.0))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation and bookkeeping options.

  Attributes:
    steps: total optimizer steps.
    batch_size: B sequences per step (global, split over devices).
    seq_len: T tokens per sequence.
    lr: peak learning rate; warmup linearly over `warmup` steps, cosine down to `lr * min_lr_ratio` at `steps`.
    weight_decay: AdamW decoupled weight decay (not applied to norms' scales, 1-D vectors or the q/k/v biases).
    clip_norm: global gradient-norm clip.
    lb_coef: weight of the switch load-balancing loss (mean over MoE layers; 1.0 is perfectly balanced).
    z_coef: weight of the router z-loss.
    bias_update_rate: auxiliary-loss-free bias step (0 disables).
    compute_dtype: "float32" or "bfloat16" (parameters stay float32; the forward runs on a cast copy).
    seed: parameter init and data order.
    save_every, keep: orbax checkpoint interval and how many to keep.
    log_every: metrics line interval.
    eval_every: validation bits/byte interval (0: only at the end).
    eval_windows: validation windows per evaluation.
  """

  steps: int = 200
  batch_size: int = 16
  seq_len: int = 128
  lr: float = 3e-3
  warmup: int = 20
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  lb_coef: float = 0.01
  z_coef: float = 1e-3
  bias_update_rate: float = 0.0
  compute_dtype: str = "float32"
  seed: int = 0
  save_every: int = 100
  keep: int = 3
  log_every: int = 10
  eval_every: int = 0
  eval_windows: int = 16

  def __post_init__(self):
    for f in ("steps", "batch_size", "seq_len", "save_every", "keep", "log_every", "eval_windows"):
      v = getattr(self, f)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"{f}={v!r} must be a positive int")
    if self.warmup < 0 or self.eval_every < 0:
      raise ValueError(f"warmup={self.warmup} and eval_every={self.eval_every} must be >= 0")
    for f in ("lr", "weight_decay", "clip_norm", "min_lr_ratio", "lb_coef", "z_coef", "bias_update_rate"):
      if not math.isfinite(getattr(self, f)):  # NaN passes every comparison below and trains NaN silently
        raise ValueError(f"{f}={getattr(self, f)} must be a finite number")
    if not self.clip_norm > 0:  # a negative clip would flip the gradient's sign
      raise ValueError(f"clip_norm={self.clip_norm} must be > 0")
    if not self.weight_decay >= 0:
      raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
    if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"lr={self.lr} must be > 0 and min_lr_ratio={self.min_lr_ratio} in [0, 1]")
    if self.compute_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"compute_dtype={self.compute_dtype!r} must be 'float32' or 'bfloat16'")
    if self.bias_update_rate < 0 or self.lb_coef < 0 or self.z_coef < 0:
      raise ValueError("bias_update_rate, lb_coef and z_coef must be >= 0")
    if not isinstance(self.seed, int) or self.seed < 0:  # numpy's data order refuses it only after the model is built
      raise ValueError(f"seed={self.seed!r} must be an int >= 0")


def learning_rate(tc: TrainConfig, step: jax.Array, total_steps: jax.Array) -> jax.Array:
  """Linear warmup to `tc.lr` over `tc.warmup` steps, then cosine to `tc.lr * tc.min_lr_ratio` at `total_steps`.

  `total_steps` is a traced value so that `--auto_steps` can fix it after timing the first steps, without a
  recompile.
  """
  step = step.astype(jnp.float32)
  warmup = tc.warmup  # 0: no warmup, the first step at the peak rate
  progress = jnp.clip((step - warmup) / jnp.maximum(total_steps - warmup, 1), 0.0, 1.0)
  cosine = tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
  return tc.lr * jnp.where(step < warmup, step / max(warmup, 1), cosine)


BIASES = ("bq", "bk", "bv")  # attention biases: [N, H] / [K, H] arrays, vectors per head
AUTO_PROBE = (10, 30)  # --auto_steps times a run's steps 10..30 (after compilation), then fixes the total


def _decayed(path, x) -> bool:
  """Weight decay on matrices only: not on norms' scales, 1-D vectors, or the q/k/v biases (2-D, per head)."""
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]  # nnx.State paths end in .value
  return x.ndim >= 2 and not (keys and keys[-1] in BIASES)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """Clip, then AdamW's direction (Adam + decoupled weight decay); the step multiplies by the learning rate."""
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(_decayed, params)
  return optax.chain(
      optax.clip_by_global_norm(tc.clip_norm),
      optax.scale_by_adam(b1=0.9, b2=0.95),
      optax.add_decayed_weights(tc.weight_decay, mask=decay_mask),
  )


@functools.lru_cache(maxsize=8)
def _state_builder(config: ModelConfig, tc: TrainConfig) -> Callable[[], dict[str, Any]]:
  @jax.jit
  def build():
    _, params, rest = nnx.split(init_model(config, seed=tc.seed), nnx.Param, ...)
    return {"params": params, "rest": rest, "opt_state": make_optimizer(tc).init(params),
            "step": jnp.zeros((), jnp.int32)}
  return build


def init_state(config: ModelConfig, tc: TrainConfig) -> tuple[nnx.GraphDef, dict[str, Any]]:
  """A fresh train state (float32 parameters whatever `config.param_dtype`, for stable AdamW).

  Built in one jitted function (eager initialisation would compile every random draw separately), compiled once
  per (config, options) in a process.
  """
  config = config.replace(param_dtype="float32")
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(config, seed=tc.seed)))
  return graphdef, _state_builder(config, tc)()


def model_from_state(graphdef: nnx.GraphDef, state: dict[str, Any]) -> Transformer:
  return nnx.merge(graphdef, state["params"], state["rest"])


def load_workdir(workdir: str, *, step: int | None = None) -> tuple[ModelConfig, Transformer]:
  """The model of a training run: `workdir`'s orbax checkpoint at `step` (default: the latest) -> (config, model).

  The run's model and train configs come from the checkpoint's "meta" item; the parameters and router biases are
  the train state's exact float32 arrays (the returned config says `param_dtype="float32"`), not the bf16-rounded
  values `--export` writes. The optimizer state is read and dropped.
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"workdir={workdir!r} has no checkpoints/ directory: not a moe_jax.train --workdir")
  manager = checkpoints.train_manager(directory, read_only=True)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"workdir={workdir!r} holds no checkpoint yet (the run saves every --save_every steps)")
  if step not in manager.all_steps():
    raise ValueError(f"step={step} is not saved in {directory}; saved: {sorted(manager.all_steps())}")
  meta = checkpoints.restore_train_meta(manager, step)
  config = checkpoints.config_from_json(meta["model_config"]).replace(param_dtype="float32")
  tc = TrainConfig(**meta["train_config"])
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: init_model(config, seed=tc.seed)))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # whatever mesh the run was trained on
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                      jax.eval_shape(_state_builder(config, tc)))
  state = checkpoints.restore_train_state(manager, like, step)
  manager.close()
  return config, model_from_state(graphdef, state)


# TrainConfig fields a resumed run may change: bookkeeping, not the trajectory.
RESUME_FREE_FIELDS = ("save_every", "keep", "log_every", "eval_every", "eval_windows")


def resume_config(saved: dict, config: ModelConfig, tc: TrainConfig, *, auto_steps: bool) -> tuple[TrainConfig, bool]:
  """The TrainConfig to resume a run with, from its checkpoint's "meta" (`saved`); raises ValueError naming the
  flags when this call would train another model or follow another trajectory.

  Returns:
    (tc with the run's total steps where --auto_steps fixed it, whether the total is fixed).
  """
  norm = lambda d: json.loads(json.dumps(d))  # noqa: E731  tuples as the JSON item stores them
  ours = norm(dataclasses.asdict(config))
  if ours != saved["model_config"]:
    diff = sorted(k for k in set(ours) | set(saved["model_config"]) if ours.get(k) != saved["model_config"].get(k))
    raise ValueError(f"the workdir holds a run of another model (config fields {diff} differ, e.g. name "
                     f"{saved['model_config'].get('name')!r}): resume with its --config, or use a new --workdir")
  run, ours = saved["train_config"], norm(dataclasses.asdict(tc))
  steps_fixed = bool(saved.get("steps_fixed")) and auto_steps
  if steps_fixed:
    ours["steps"] = run["steps"]
  diff = [k for k in ours if k not in RESUME_FREE_FIELDS and run.get(k) != ours[k]]
  if diff:
    raise ValueError("the workdir's run was started with " + ", ".join(f"--{k}={run.get(k)!r}" for k in diff) +
                     "; this call passes " + ", ".join(f"--{k}={ours[k]!r}" for k in diff) +
                     ": resume with the run's flags, or use a new --workdir")
  return dataclasses.replace(tc, steps=ours["steps"]), steps_fixed


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """float32 [B, T, V] logits, int32 [B, T] targets -> mean negative log-likelihood in nats."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _cast(tree, dtype):
  """Float leaves in `dtype`, except the router's: routing runs in float32 at inference (`MoE` keeps `w_router`
  float32 whatever param_dtype), and training must choose the experts inference will."""
  def cast(path, x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or "w_router" in jax.tree_util.keystr(path):
      return x
    return x.astype(dtype)
  return jax.tree_util.tree_map_with_path(cast, tree)


@functools.lru_cache(maxsize=8)  # one compilation per (model structure, options) in a process
def make_train_step(graphdef: nnx.GraphDef, tc: TrainConfig) -> Callable:
  """Returns the jitted `step(state, batch int32 [B, T+1], total_steps) -> (state, metrics)` (state donated)."""
  optimizer = make_optimizer(tc)
  compute = jnp.dtype(tc.compute_dtype)

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, _cast(params, compute) if compute != jnp.float32 else params, rest)
    logits, auxes, _ = model.forward(batch[:, :-1])
    ce = cross_entropy(logits, batch[:, 1:])
    lb = jnp.mean(jnp.stack([a["load_balance"] for a in auxes])) if auxes else jnp.zeros(())
    z = jnp.mean(jnp.stack([a["z_loss"] for a in auxes])) if auxes else jnp.zeros(())
    counts = [a["expert_counts"] for a in auxes]
    return ce + tc.lb_coef * lb + tc.z_coef * z, (ce, lb, z, counts)

  def step(state, batch, total_steps):
    (loss, (ce, lb, z, counts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], state["rest"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    lr = learning_rate(tc, state["step"], total_steps)
    params = jax.tree.map(lambda p, u: p - lr * u, state["params"], updates)
    rest = state["rest"]
    if tc.bias_update_rate > 0 and counts:
      model = nnx.merge(graphdef, params, rest)
      moe_blocks = [b for b in model.blocks if hasattr(b.ffn, "router_bias")]
      for block, c in zip(moe_blocks, counts):
        c = c.astype(jnp.float32)
        block.ffn.router_bias[...] = block.ffn.router_bias[...] + tc.bias_update_rate * jnp.sign(jnp.mean(c) - c)
      _, _, rest = nnx.split(model, nnx.Param, ...)
    imbalance = (jnp.mean(jnp.stack([jnp.max(c) / jnp.maximum(jnp.mean(c), 1e-9) for c in counts]))
                 if counts else jnp.ones(()))
    metrics = {"loss": loss, "ce": ce, "bpb": ce / LN2, "load_balance": lb, "z_loss": z,
               "grad_norm": optax.tree.norm(grads), "lr": lr,
               "max_expert_load": imbalance}
    return {"params": params, "rest": rest, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  return jax.jit(step, donate_argnums=0)


@functools.lru_cache(maxsize=8)
def make_eval_fn(graphdef: nnx.GraphDef) -> Callable:
  """Jitted `(params, rest, windows int32 [W, T+1]) -> mean nats per token` through the full causal forward."""

  @jax.jit
  def eval_fn(params, rest, windows):
    logits, _, _ = nnx.merge(graphdef, params, rest).forward(windows[:, :-1])
    return cross_entropy(logits, windows[:, 1:])

  return eval_fn


def _mesh_shardings(batch_size: int):
  """(batch sharding, replicated sharding), or (None, None) on one device."""
  n = jax.device_count()
  if n == 1:
    return None, None
  if batch_size % n:
    raise ValueError(f"batch_size={batch_size} must be divisible by the {n} devices for data parallelism")
  # Auto axes: XLA propagates the batch sharding through the model (the MoE's sort and gathers included).
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  return NamedSharding(mesh, P("data")), NamedSharding(mesh, P())


def read_metrics(path: str) -> list[dict[str, float]]:
  """The JSON lines of a `metrics.jsonl` (a workdir's, or `assets/tiny-trained/train_metrics.jsonl`)."""
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path: str, step: int) -> None:
  """Drops metric lines logged after `step` (written before an interruption, recomputed on resume)."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = [l for l in f if l.strip() and json.loads(l).get("step", 0) <= step]
  with open(path, "w") as f:
    f.writelines(lines)


def train(config: ModelConfig, tc: TrainConfig, workdir: str, *, max_seconds: float | None = None,
          stop_after: int | None = None, progress: bool = True, export_dir: str | None = None,
          corpus: dict | None = None, auto_steps: bool = False, stop_at: int | None = None) -> dict[str, Any]:
  """Trains (resuming from `workdir` if it holds a checkpoint) and returns a summary dict.

  Args:
    config: model shape.
    tc: training options.
    workdir: orbax checkpoints under `workdir/checkpoints`, metrics in `workdir/metrics.jsonl`.
    max_seconds: stop (and save) once this much wall time has passed in the loop.
    stop_after: stop at this step without a final save (simulates a killed process in tests).
    progress: show a tqdm bar.
    export_dir: write the compact shipped checkpoint here at the end.
    corpus: `moe_jax.data.load_corpus()` result (loaded if None).
    stop_at: end this run after this step (saving and exporting as at the end), whatever the schedule's total.
    auto_steps: with `max_seconds`, time steps 10..30 (after compilation) and set the total (hence the cosine
      schedule's end) to what fits in `max_seconds`; the summary records the total, which `--steps` reproduces
      (needs warmup >= 30, so that the timed steps' learning rates do not depend on the total).
  """
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  if tc.seq_len > config.max_seq_len:  # the model would be trained at positions it is not built to decode
    raise ValueError(f"seq_len={tc.seq_len} exceeds max_seq_len={config.max_seq_len} of config {config.name!r}")
  if stop_at is not None and (not isinstance(stop_at, int) or stop_at < 1):
    raise ValueError(f"stop_at={stop_at!r} must be an int >= 1 (None: run the whole schedule)")
  if auto_steps and not (max_seconds is not None and max_seconds > 0):  # before: ignored, the total never fixed
    raise ValueError(f"auto_steps fits the total steps to max_seconds, which must be > 0 (got {max_seconds!r})")
  corpus = corpus or data_lib.load_corpus()
  train_tokens, val_tokens = corpus["train"].tokens, corpus["validation"].tokens
  print(f"corpus: {data_lib.describe(corpus)}", flush=True)
  os.makedirs(workdir, exist_ok=True)
  metrics_path = os.path.join(workdir, "metrics.jsonl")

  manager = checkpoints.train_manager(os.path.join(workdir, "checkpoints"), save_every=tc.save_every, keep=tc.keep)
  steps_fixed = False
  if manager.latest_step() is not None:  # resuming: the same run, or a clear error before orbax's structure mismatch
    saved = checkpoints.restore_train_meta(manager, manager.latest_step())
    tc, steps_fixed = resume_config(saved, config, tc, auto_steps=auto_steps)
  graphdef, state = init_state(config, tc)
  restored = checkpoints.restore_train_state(manager, state)
  if restored is not None:
    state = restored
    print(f"resumed from step {int(state['step'])}", flush=True)
  start = int(state["step"])
  _truncate_metrics(metrics_path, start)

  batch_sharding, replicated = _mesh_shardings(tc.batch_size)
  if replicated is not None:
    state = jax.device_put(state, replicated)
  step_fn = make_train_step(graphdef, tc)
  eval_fn = make_eval_fn(graphdef)
  val_windows = jnp.asarray(data_lib.eval_windows(val_tokens, n_windows=tc.eval_windows, seq_len=tc.seq_len))
  meta = {"model_config": dataclasses.asdict(config), "train_config": dataclasses.asdict(tc), "steps_fixed": steps_fixed}
  auto_steps = auto_steps and not steps_fixed  # a resumed --auto_steps run keeps the total it fixed
  probe_start, probe_end = (start + i for i in AUTO_PROBE)
  if auto_steps and max_seconds and tc.warmup < probe_end:
    # The steps before the total is known must not depend on it: the warmup's do not, the cosine's do.
    raise ValueError(f"--auto_steps times steps {probe_start}..{probe_end} before it fixes the schedule's total; "
                     f"--warmup={tc.warmup} must be >= {probe_end} so that those steps' learning "
                     "rates do not depend on it (and --steps=<the total> replays the run)")

  last, t0, t_log, tokens_since = None, time.time(), time.time(), 0
  total_steps, t_probe = tc.steps, None
  bar = tqdm(total=tc.steps, initial=start, disable=not progress, dynamic_ncols=True)
  step = start
  with open(metrics_path, "a") as mf:
    while step < min(total_steps, stop_at or total_steps):
      batch = data_lib.train_batch(train_tokens, step, batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed)
      batch = jax.device_put(batch, batch_sharding) if batch_sharding is not None else jnp.asarray(batch)
      state, m = step_fn(state, batch, jnp.float32(total_steps))
      tokens_since += tc.batch_size * tc.seq_len
      done = step + 1
      bar.update(1)
      if auto_steps and max_seconds and done == probe_start:
        jax.block_until_ready(state)
        t_probe = time.time()
      if auto_steps and max_seconds and done == probe_end:
        jax.block_until_ready(state)
        per_step = (time.time() - t_probe) / (probe_end - probe_start)
        fit = done + int((max_seconds - (time.time() - t0)) / per_step)
        total_steps = max(done + tc.log_every, fit // 100 * 100)
        tc = dataclasses.replace(tc, steps=total_steps)
        meta["train_config"], meta["steps_fixed"] = dataclasses.asdict(tc), True
        bar.total = total_steps
        print(f"\nauto_steps: {per_step * 1e3:.2f} ms/step -> steps={total_steps}", flush=True)
      validate = bool(tc.eval_every) and done % tc.eval_every == 0  # a line of its own if not a logging step
      if done % tc.log_every == 0 or done == total_steps or validate:
        m = {k: float(v) for k, v in m.items()}
        now = time.time()
        m.update(step=done, tokens_per_s=tokens_since / max(now - t_log, 1e-9), time=now - t0)
        t_log, tokens_since = now, 0
        if validate:
          m["val_bpb"] = float(eval_fn(state["params"], state["rest"], val_windows)) / LN2
          t_log = time.time()  # the validation's time is not the next interval's training time
        mf.write(json.dumps(m) + "\n")
        mf.flush()
        bar.set_postfix(loss=f"{m['loss']:.3f}", bpb=f"{m['bpb']:.3f}", tok_s=f"{m['tokens_per_s']:.3g}")
        last = m
      if done == start + 1:  # later lines' tokens_per_s without the first step's compilation
        jax.block_until_ready(state)
        t_log, tokens_since = time.time(), 0
      if stop_after is not None and done >= stop_after:
        manager.wait_until_finished()
        return {"step": done, "stopped": True}
      manager.save(done, args=checkpoints.train_save_args(state, meta))
      if max_seconds is not None and time.time() - t0 > max_seconds:
        print(f"stopping at step {done}: max_seconds={max_seconds} reached", flush=True)
        break
      step = done
  done = int(state["step"])
  if manager.latest_step() != done:
    manager.save(done, args=checkpoints.train_save_args(state, meta), force=True)
  manager.wait_until_finished()
  val_bpb = float(eval_fn(state["params"], state["rest"], val_windows)) / LN2
  unigram = data_lib.unigram_bits_per_byte(train_tokens, val_tokens)
  summary = {"step": done, "steps": total_steps, "val_bpb_forward": val_bpb, "val_windows": tc.eval_windows,
             "seq_len": tc.seq_len, "unigram_bpb": unigram, "train_bpb_last": last["bpb"] if last else None,
             "train_seconds": time.time() - t0, "devices": jax.device_count(),
             "device_kind": jax.devices()[0].device_kind}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary), flush=True)
  if export_dir:
    checkpoints.export(model_from_state(graphdef, state), config, export_dir,
                       extra={"train_config": dataclasses.asdict(tc), "train_summary": summary})
    print(f"exported to {export_dir}", flush=True)
  return summary


def main(argv):
  del argv
  import configs  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  tc = TrainConfig(steps=f.steps, batch_size=f.batch_size, seq_len=f.seq_len, lr=f.lr, warmup=f.warmup,
                   weight_decay=f.weight_decay, clip_norm=f.clip_norm, lb_coef=f.lb_coef, z_coef=f.z_coef,
                   bias_update_rate=f.bias_update_rate, compute_dtype=f.compute_dtype, seed=f.seed,
                   save_every=f.save_every, keep=f.keep, log_every=f.log_every, eval_every=f.eval_every,
                   eval_windows=f.eval_windows)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  train(configs.get(f.config, flag="--config"), tc, f.workdir, max_seconds=f.max_seconds, export_dir=f.export or None,
        auto_steps=f.auto_steps, stop_at=f.stop_at)


if __name__ == "__main__":
  from absl import app, flags, logging

  _d = TrainConfig()
  flags.DEFINE_string("config", "tiny", "Model preset (configs/).")
  flags.DEFINE_string("workdir", None, "Checkpoints and metrics directory (resumed if it holds a checkpoint).",
                      required=True)
  flags.DEFINE_integer("steps", _d.steps, "Total optimizer steps.")
  flags.DEFINE_integer("batch_size", _d.batch_size, "Global batch (sequences).")
  flags.DEFINE_integer("seq_len", _d.seq_len, "Tokens per training sequence.")
  flags.DEFINE_float("lr", _d.lr, "Peak learning rate.")
  flags.DEFINE_integer("warmup", _d.warmup, "Linear warmup steps.")
  flags.DEFINE_float("weight_decay", _d.weight_decay, "AdamW weight decay.")
  flags.DEFINE_float("clip_norm", _d.clip_norm, "Global gradient-norm clip.")
  flags.DEFINE_float("lb_coef", _d.lb_coef, "Switch load-balancing loss weight.")
  flags.DEFINE_float("z_coef", _d.z_coef, "Router z-loss weight.")
  flags.DEFINE_float("bias_update_rate", _d.bias_update_rate, "Aux-loss-free router bias step (0: off).")
  flags.DEFINE_enum("compute_dtype", _d.compute_dtype, ["float32", "bfloat16"], "Forward/backward dtype.")
  flags.DEFINE_integer("seed", _d.seed, "Init and data seed.")
  flags.DEFINE_integer("save_every", _d.save_every, "Checkpoint interval (steps).")
  flags.DEFINE_integer("keep", _d.keep, "Checkpoints kept.")
  flags.DEFINE_integer("log_every", _d.log_every, "Metrics interval (steps).")
  flags.DEFINE_integer("eval_every", _d.eval_every, "Validation interval (steps; 0: end only).")
  flags.DEFINE_integer("eval_windows", _d.eval_windows, "Validation windows.")
  flags.DEFINE_float("max_seconds", None, "Stop (and save) after this many seconds of training.")
  flags.DEFINE_integer("stop_at", None, "End the run after this step (saved, exported); the schedule keeps --steps.")
  flags.DEFINE_bool("auto_steps", False, "With --max_seconds: set --steps to what fits, from the measured step time.")
  flags.DEFINE_string("export", "", "Write the compact shipped checkpoint to this directory at the end.")
  app.run(main)
