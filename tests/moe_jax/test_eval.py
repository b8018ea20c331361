"""Evaluation harness: the decode path agrees with the full forward, variants are compared to the baseline, the
shipped checkpoint reproduces its recorded bits per byte."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import checkpoints, data, decode
from moe_jax import eval as eval_lib

CONTEXT, PREFIX = 32, 8


@pytest.fixture(scope="module")
def windows():
  tokens = data.load_corpus()["validation"].tokens
  return data.eval_windows(tokens, n_windows=3, seq_len=CONTEXT)


def test_teacher_forced_decode_matches_the_full_forward(tiny_model, tiny_config, windows):
  out = eval_lib.evaluate(tiny_model, tiny_config, kv_cache="fp32", windows=windows, context=CONTEXT, prefix=PREFIX)
  logp = jax.nn.log_softmax(decode.logits(tiny_model, jnp.asarray(windows[:, :-1])), axis=-1)
  targets = windows[:, PREFIX:]
  nll = -np.take_along_axis(np.asarray(logp)[:, PREFIX - 1:], targets[..., None], axis=-1)
  assert out["scored_tokens"] == targets.size == 3 * (CONTEXT - PREFIX + 1)
  np.testing.assert_allclose(out["bpb"], nll.mean() / np.log(2), rtol=1e-4)
  # fp32 vs the bf16 baseline cache: nearly the same predictions.
  assert out["agreement"] > 0.95 and 0 <= out["kl"] < 1e-3


def test_baseline_and_a_registered_variant(tiny_model, tiny_config, windows):
  base = eval_lib.evaluate(tiny_model, tiny_config, windows=windows, context=CONTEXT, prefix=PREFIX)
  assert base["agreement"] == 1.0 and base["kl"] == 0.0 and base["bpb"] == base["baseline_bpb"]

  def perturb(model):  # the harness hands over a clone: modifying it must not touch the baseline
    for block in model.blocks:
      block.ffn.w_down[...] = block.ffn.w_down[...] * 3.0
    return model

  eval_lib.ROUTING_MODES["test-perturb"] = perturb
  try:
    out = eval_lib.evaluate(tiny_model, tiny_config, routing="test-perturb", windows=windows, context=CONTEXT,
                            prefix=PREFIX)
  finally:
    del eval_lib.ROUTING_MODES["test-perturb"]
  assert out["kl"] > 1e-3 and out["agreement"] < 1.0
  assert out["baseline_bpb"] == base["bpb"]
  again = eval_lib.evaluate(tiny_model, tiny_config, windows=windows, context=CONTEXT, prefix=PREFIX)
  assert again["bpb"] == base["bpb"]
  assert "| bpb |" in eval_lib.markdown(out)
  assert f"| {out['kl']:.2e} |" in eval_lib.markdown(out)  # a KL of 4e-5 printed as 0.0000 before


@pytest.mark.parametrize("flag", ["kv_cache", "expert_quant", "routing"])
def test_unknown_modes_name_the_flag(tiny_model, tiny_config, flag):
  with pytest.raises(ValueError, match=f"{flag}='no-such-mode'"):
    eval_lib.evaluate(tiny_model, tiny_config, **{flag: "no-such-mode"})


def test_no_windows_is_refused_not_a_nan_table(tiny_model, tiny_config):
  with pytest.raises(ValueError, match="n_windows=0 must be an int >= 1"):
    eval_lib.evaluate(tiny_model, tiny_config, n_windows=0)


def test_given_windows_are_checked_before_the_model_runs(tiny_model, tiny_config, windows):
  """Before: -1 was scored as the last vocabulary entry, 300 failed inside numpy after the model ran, no rows gave a
  NaN table and float windows were truncated."""
  bad = np.array(windows)
  bad[1, 5] = -1
  with pytest.raises(ValueError, match=r"windows: token id -1 at tokens\[1, 5\] is outside the vocabulary"):
    eval_lib.evaluate(tiny_model, tiny_config, windows=bad, context=CONTEXT, prefix=PREFIX)
  bad[1, 5] = tiny_config.vocab_size + 36
  with pytest.raises(ValueError, match=f"token id {tiny_config.vocab_size + 36} at"):
    eval_lib.evaluate(tiny_model, tiny_config, windows=bad, context=CONTEXT, prefix=PREFIX)
  with pytest.raises(ValueError, match=r"windows must be \[W >= 1"):
    eval_lib.evaluate(tiny_model, tiny_config, windows=np.zeros((0, CONTEXT + 1), np.int32), context=CONTEXT,
                      prefix=PREFIX)
  with pytest.raises(ValueError, match="integer token ids, got dtype float64"):
    eval_lib.evaluate(tiny_model, tiny_config, windows=np.asarray(windows) + 0.5, context=CONTEXT, prefix=PREFIX)


def test_a_context_of_max_seq_len_runs(tiny_model, tiny_config, windows):
  """A window feeds `context` tokens (its last is only a target); the harness asked for context + 1 positions and
  refused context == max_seq_len. The model at that limit scores as the same weights with room to spare."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  at_limit = dataclasses.replace(tiny_config, max_seq_len=CONTEXT)
  model = nnx.clone(tiny_model)
  model.config = at_limit
  out = eval_lib.evaluate(model, at_limit, kv_cache="fp32", windows=windows, context=CONTEXT, prefix=PREFIX)
  ref = eval_lib.evaluate(tiny_model, tiny_config, kv_cache="fp32", windows=windows, context=CONTEXT, prefix=PREFIX)
  np.testing.assert_allclose(out["bpb"], ref["bpb"], rtol=1e-6)
  with pytest.raises(ValueError, match=f"context={CONTEXT + 1} exceeds max_seq_len={CONTEXT}"):
    eval_lib.evaluate(model, at_limit, windows=np.zeros((1, CONTEXT + 2), np.int32), context=CONTEXT + 1,
                      prefix=PREFIX)


def test_record_refuses_the_settings_it_would_drop(tmp_path):
  """`--record` measures with the defaults; before, it took --kv_cache / --expert_quant / --context ... (even names
  of no mode) and wrote the defaults' metrics without a word."""
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
  args = [sys.executable, "-m", "moe_jax.eval", f"--checkpoint={tmp_path}/none", "--record", "--kv_cache=int8",
          "--context=32"]
  r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert "--record measures the checkpoint with the defaults; drop --kv_cache, --context" in r.stderr, r.stderr[-2000:]


def test_shipped_checkpoint_reproduces_its_recorded_bpb():
  recorded = checkpoints.recorded_metrics("tiny-trained")
  config, model = checkpoints.load("tiny-trained")
  rec = recorded["decode_eval"]
  out = eval_lib.evaluate(model, config, n_windows=rec["n_windows"], context=rec["context"], prefix=rec["prefix"])
  assert abs(out["bpb"] - rec["bpb"]) <= 0.01 * rec["bpb"], (out["bpb"], rec["bpb"])
  # The cache it records is the one evaluate builds (context positions; it had one more before 95e0202).
  assert out["kv_cache_bytes"] == rec["kv_cache_bytes"], (out["kv_cache_bytes"], rec["kv_cache_bytes"])
  # And it is clearly a trained model: far below the unigram baseline of the same corpus.
  assert out["bpb"] < 0.5 * recorded["unigram_bpb"]
