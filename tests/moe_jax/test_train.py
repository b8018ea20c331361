"""Training: the loss goes down, the aux-loss-free bias follows its rule, bf16 compute agrees, resume is exact."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import data, train

# One options set for every test (the aux-loss-free bias update on), so the step compiles once per process.
TC = train.TrainConfig(steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup=2, save_every=4, keep=2, log_every=1,
                       eval_windows=2, bias_update_rate=0.01)


@pytest.fixture(scope="module")
def config(tiny_config):
  # One block keeps the compile of the train step short on a loaded CPU; every code path is still there.
  return tiny_config.replace(n_layers=1, name="tiny-1block")


@pytest.fixture(scope="module")
def batch():
  tokens = data.load_corpus()["train"].tokens
  return jnp.asarray(data.train_batch(tokens, 0, batch_size=4, seq_len=32))


def test_a_few_steps_reduce_the_loss(config, batch):
  graphdef, state = train.init_state(config, TC)
  step = train.make_train_step(graphdef, TC)
  losses = []
  for _ in range(8):
    state, m = step(state, batch, jnp.float32(TC.steps))
    losses.append(float(m["ce"]))
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0] - 0.5, losses
  assert int(state["step"]) == 8


def test_bias_update_follows_the_sign_rule(config, batch):
  tc = TC
  graphdef, state = train.init_state(config, TC)
  model = train.model_from_state(graphdef, state)
  auxes = jax.jit(lambda m, x: m.forward(x)[1])(model, batch[:, :-1])
  state, _ = train.make_train_step(graphdef, tc)(state, batch, jnp.float32(tc.steps))
  new = train.model_from_state(graphdef, state)
  for block, aux in zip(new.blocks, auxes):
    c = np.asarray(aux["expert_counts"], np.float32)
    np.testing.assert_allclose(np.asarray(block.ffn.router_bias[...]), 0.01 * np.sign(c.mean() - c), atol=1e-7)


def test_bf16_compute_tracks_float32(config, batch):
  graphdef, state = train.init_state(config, TC)
  _, m32 = train.make_train_step(graphdef, TC)(state, batch, jnp.float32(12))
  tc16 = dataclasses.replace(TC, compute_dtype="bfloat16")
  graphdef, state = train.init_state(config, TC)
  _, m16 = train.make_train_step(graphdef, tc16)(state, batch, jnp.float32(12))
  assert abs(float(m16["ce"]) - float(m32["ce"])) < 0.05 * float(m32["ce"])


def test_bf16_compute_keeps_the_router_float32(config):
  """Inference routes with the float32 router whatever param_dtype; before, bf16 training rounded it to bf16 and
  chose other experts for near ties (1 of 1024 tokens of the tiny preset)."""
  from moe_jax import decode  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  _, params, _ = nnx.split(decode.init_model(config), nnx.Param, ...)
  cast = nnx.to_pure_dict(train._cast(params, jnp.bfloat16))  # pylint: disable=protected-access
  ffn = cast["blocks"][0]["ffn"]
  assert ffn["w_router"].dtype == jnp.float32
  assert ffn["w_gate"].dtype == jnp.bfloat16 and cast["blocks"][0]["attn"]["wq"].dtype == jnp.bfloat16


def test_learning_rate_schedule():
  tc = train.TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
  lr = lambda s: float(train.learning_rate(tc, jnp.int32(s), jnp.float32(100)))
  assert lr(0) == 0.0 and abs(lr(5) - 0.5) < 1e-6 and abs(lr(10) - 1.0) < 1e-6
  assert abs(lr(55) - 0.55) < 1e-3 and abs(lr(100) - 0.1) < 1e-6
  with pytest.raises(ValueError, match="compute_dtype"):
    train.TrainConfig(compute_dtype="int8")


def test_sequences_longer_than_the_model_are_refused(tmp_path, config):
  tc = dataclasses.replace(TC, seq_len=config.max_seq_len + 1)
  with pytest.raises(ValueError, match=f"seq_len={config.max_seq_len + 1} exceeds max_seq_len"):
    train.train(config, tc, str(tmp_path), progress=False)
  assert not (tmp_path / "metrics.jsonl").exists()


def _losses(workdir):
  with open(f"{workdir}/metrics.jsonl") as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def test_resume_after_interruption_continues_identically(config, tmp_path):
  corpus = data.load_corpus()
  train.train(config, TC, str(tmp_path / "straight"), progress=False, corpus=corpus)
  # "Killed" after step 10: the last checkpoint is step 8, steps 9-10 were logged but are recomputed.
  out = train.train(config, TC, str(tmp_path / "resumed"), progress=False, corpus=corpus, stop_after=10)
  assert out["stopped"] and _losses(tmp_path / "resumed")[-1][0] == 10
  train.train(config, TC, str(tmp_path / "resumed"), progress=False, corpus=corpus)
  straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
  assert [s for s, _ in resumed] == list(range(1, 13))
  assert straight == resumed  # bitwise-equal losses, step by step
  # A resume with other settings is refused, naming them (before: --lr and --seed were taken silently and another
  # --config ended in orbax's structure mismatch); bookkeeping flags may change.
  with pytest.raises(ValueError, match=r"started with --lr=0.003, --seed=0; this call passes --lr=1.0, --seed=5"):
    train.train(config, dataclasses.replace(TC, lr=1.0, seed=5), str(tmp_path / "resumed"), progress=False,
                corpus=corpus)
  with pytest.raises(ValueError, match=r"another model \(config fields \['n_layers'\]"):
    train.train(config.replace(n_layers=2), TC, str(tmp_path / "resumed"), progress=False, corpus=corpus)
  assert train.train(config, dataclasses.replace(TC, log_every=3), str(tmp_path / "resumed"), progress=False,
                     corpus=corpus)["step"] == 12


def test_a_resumed_auto_steps_run_keeps_the_total_it_fixed(config):
  saved = {"model_config": json.loads(json.dumps(dataclasses.asdict(config))),
           "train_config": dataclasses.asdict(dataclasses.replace(TC, steps=200)), "steps_fixed": True}
  tc, fixed = train.resume_config(saved, config, dataclasses.replace(TC, steps=100000), auto_steps=True)
  assert fixed and tc.steps == 200  # before: the run went on with --steps=100000's schedule and timed itself again
  with pytest.raises(ValueError, match="--steps=200.*--steps=100000"):
    train.resume_config(saved, config, dataclasses.replace(TC, steps=100000), auto_steps=False)
  saved["steps_fixed"] = False  # stopped before the timing fixed it: timed again
  assert train.resume_config(saved, config, dataclasses.replace(TC, steps=200), auto_steps=True) == (
      dataclasses.replace(TC, steps=200), False)


@pytest.mark.parametrize("change, message", [
    (dict(clip_norm=-1.0), "clip_norm=-1.0 must be > 0"),  # before: trained uphill (optax scaled by max_norm < 0)
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be >= 0"),
    (dict(lr=float("nan")), "lr=nan must be a finite number"),  # before: every metric and checkpoint NaN
    (dict(lr=float("inf")), "lr=inf must be a finite number"),
    (dict(z_coef=float("nan")), "z_coef=nan must be a finite number"),
    (dict(weight_decay=float("inf")), "weight_decay=inf must be a finite number"),
    (dict(seed=-1), "seed=-1 must be an int >= 0"),  # before: numpy's error, after the model was built
])
def test_train_config_names_bad_optimizer_settings(change, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(TC, **change)


def test_zero_warmup_starts_at_the_peak_rate_and_stop_at_is_checked(config, tmp_path):
  tc = train.TrainConfig(steps=100, warmup=0, lr=1.0)
  assert float(train.learning_rate(tc, jnp.int32(0), jnp.float32(100))) == 1.0  # before: 0 at step 0
  for bad in (0, -5):  # before: 0 meant "no limit", -5 ran no step and still saved and exported
    with pytest.raises(ValueError, match=f"stop_at={bad} must be an int >= 1"):
      train.train(config, TC, str(tmp_path), progress=False, stop_at=bad)


_DP_SCRIPT = """
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import configs
from moe_jax import data, train
tc = train.TrainConfig(**json.loads(sys.argv[2]))
config = configs.get("tiny").replace(n_layers=1, name="tiny-1block")
train.train(config, tc, sys.argv[1], progress=False, stop_at=2)
print(jax.device_count())
"""


def test_data_parallel_matches_one_device(config, tmp_path):
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  train.train(config, TC, str(tmp_path / "one"), progress=False, stop_at=2)
  out = subprocess.run([sys.executable, "-c", _DP_SCRIPT, str(tmp_path / "two"), json.dumps(TC.__dict__)],
                       capture_output=True, text=True, check=True)
  assert out.stdout.strip().splitlines()[-1] == "2"
  one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert [s for s, _ in one] == [1, 2]
  np.testing.assert_allclose([l for _, l in two], [l for _, l in one], rtol=1e-4)


def test_weight_decay_spares_norms_and_the_qkv_biases(config):
  """The q/k/v biases are [N, H] / [K, H] arrays: decayed before by the ndim rule (an update of lr·wd·p from zero
  gradients); matrices are decayed, norm scales and biases not."""
  from moe_jax import decode  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = decode.init_model(config.replace(qkv_bias=True))
  _, params, _ = nnx.split(model, nnx.Param, ...)  # the train state's params (an nnx.State, as init_state has)
  params = jax.tree.map(jnp.ones_like, params)
  tc = train.TrainConfig(steps=10, warmup=0, lr=1.0, weight_decay=0.1)
  opt = train.make_optimizer(tc)
  updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
  updates = nnx.to_pure_dict(updates)
  attn = updates["blocks"][0]["attn"]
  for name in ("bq", "bk", "bv"):
    assert float(jnp.abs(attn[name]).max()) == 0.0, name
  assert float(jnp.abs(updates["blocks"][0]["attn_norm"]["scale"]).max()) == 0.0
  assert float(jnp.abs(attn["wq"]).min()) > 0.0  # lr · wd · 1 at step 0 (no warmup)


def test_validation_runs_at_eval_every_even_off_the_logging_steps(config, tmp_path):
  """log_every 2, eval_every 3: val_bpb at step 3 and at 6 (before: only where both divide, step 6); --auto_steps
  with a warmup shorter than its timed steps is refused (their rates would depend on the total it then fixes)."""
  tc = dataclasses.replace(TC, steps=6, log_every=2, eval_every=3)
  train.train(config, tc, str(tmp_path / "run"), progress=False)
  lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [2, 3, 4, 6]
  assert [m["step"] for m in lines if "val_bpb" in m] == [3, 6]
  with pytest.raises(ValueError, match="--warmup=2 must be >= 30"):
    train.train(config, TC, str(tmp_path / "auto"), progress=False, max_seconds=60, auto_steps=True)
  for max_seconds in (None, 0):  # before: auto_steps ignored, the total never fixed
    with pytest.raises(ValueError, match=rf"to max_seconds, which must be > 0 \(got {max_seconds}\)"):
      train.train(config, TC, str(tmp_path / "auto"), progress=False, max_seconds=max_seconds, auto_steps=True)
