"""Checkpoints: the orbax train-state round trip is bitwise; the shipped format round-trips and loads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import checkpoints, decode, train


def _assert_trees_equal(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_train_state_round_trip_is_bitwise(tiny_model, tmp_path):
  # The train state's structure (nnx States of params and router biases, optax state, step), filled below.
  _, params, rest = nnx.split(tiny_model, nnx.Param, ...)
  state = {"params": params, "rest": rest, "opt_state": train.make_optimizer(train.TrainConfig()).init(params),
           "step": jnp.zeros((), jnp.int32)}
  # Non-trivial optimizer moments and router biases, from fresh random values.
  leaves, treedef = jax.tree_util.tree_flatten(state)
  rng = np.random.default_rng()
  state = jax.tree_util.tree_unflatten(treedef, [
      jax.numpy.asarray(rng.standard_normal(x.shape).astype(x.dtype) if np.issubdtype(x.dtype, np.floating)
                        else np.asarray(x) + 7) for x in leaves])
  manager = checkpoints.train_manager(str(tmp_path / "ckpt"), save_every=1, keep=1)
  manager.save(3, args=checkpoints.train_save_args(state, {"note": "x"}))
  manager.wait_until_finished()
  assert manager.latest_step() == 3
  restored = checkpoints.restore_train_state(manager, state)
  _assert_trees_equal(state, restored)


def test_export_load_round_trip(tiny_model, tiny_config, tmp_path):
  checkpoints.export(tiny_model, tiny_config, str(tmp_path / "f32"), storage_dtype="float32")
  config, model = checkpoints.load(str(tmp_path / "f32"))
  assert config == tiny_config
  _assert_trees_equal(checkpoints.named_variables(tiny_model), checkpoints.named_variables(model))
  # bfloat16 storage: every value is the bf16 rounding of the original, loaded back as float32.
  checkpoints.export(tiny_model, tiny_config, str(tmp_path / "bf16"))
  _, model16 = checkpoints.load(str(tmp_path / "bf16"))
  for name, x in checkpoints.named_variables(tiny_model).items():
    y = checkpoints.named_variables(model16)[name]
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(jax.numpy.bfloat16).astype(x.dtype)))


def test_load_errors(tmp_path):
  with pytest.raises(ValueError, match="checkpoint='nope'"):
    checkpoints.load("nope")
  (tmp_path / "checkpoints").mkdir()  # a training workdir: the message says how to export it (or where it loads)
  with pytest.raises(ValueError, match=r"moe_jax\.cli\.load_checkpoint .*`python -m moe_jax\.train \.\.\. "
                                       r"--export=DIR`"):
    checkpoints.load(str(tmp_path))


def test_export_keeps_extra_and_load_trusts_the_file_not_a_partial_config(tiny_model, tiny_config, tmp_path):
  """`extra` reaches config.json (train --export's train_config / train_summary were dropped); the storage dtype is
  read from the safetensors file (a config.json without it loaded bf16 bit patterns as numbers: 16256.0 for 1.0);
  a config.json missing a field, a Hugging Face directory and a bad storage dtype are named."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  d = str(tmp_path / "bf16")
  checkpoints.export(tiny_model, tiny_config, d, extra={"train_summary": {"steps": 3}})
  path = os.path.join(d, "config.json")
  with open(path) as f:
    meta = json.load(f)
  assert meta["train_summary"] == {"steps": 3} and meta["storage_dtype"] == "bfloat16"
  del meta["storage_dtype"]
  with open(path, "w") as f:
    json.dump(meta, f)
  _, model = checkpoints.load(d)
  want = np.asarray(tiny_model.final_norm.scale[...].astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(model.final_norm.scale[...]), want)
  del meta["model"]["rope_theta"]
  with open(path, "w") as f:
    json.dump(meta, f)
  with pytest.raises(ValueError, match=r"config.json lacks ModelConfig fields \['rope_theta'\]"):
    checkpoints.load(d)
  with open(path, "w") as f:
    json.dump({"model_type": "qwen3_moe", "hidden_size": 64}, f)
  with pytest.raises(ValueError, match=r"no \"model\" entry.*Hugging Face checkpoint: load it with --hf"):
    checkpoints.load(d)
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  weights = os.path.join(d, "model.safetensors")
  save_file(load_file(weights), weights, metadata={"storage_dtype": "float32"})  # bf16 bit patterns called float32
  with open(path, "w") as f:
    json.dump({**meta, "model": checkpoints.config_to_json(tiny_config)}, f)
  with pytest.raises(ValueError, match=r"stored as uint16 under storage_dtype='float32'"):
    checkpoints.load(d)
  with pytest.raises(ValueError, match="storage_dtype='int8' must be one of"):
    checkpoints.export(tiny_model, tiny_config, str(tmp_path / "int8"), storage_dtype="int8")
  assert not os.path.exists(tmp_path / "int8")  # refused before creating the directory


def test_shipped_checkpoint_loads_and_is_small():
  import os  # pylint: disable=g-import-not-at-top
  directory = checkpoints.resolve("tiny-trained")
  size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
  assert size <= 10 * 2**20
  config, model = checkpoints.load("tiny-trained")
  assert config.name == "tiny-trained" and config.head_dim >= 32 and config.n_layers >= 2
  import configs  # pylint: disable=g-import-not-at-top
  assert configs.get("tiny-trained") == config
  tokens = np.array([[257] + list(b"import os\nimport sys\n")], np.int32)
  logits = np.asarray(decode.logits(model, tokens))
  # A trained byte model is confident on boilerplate: "import s" -> "y" after "import os\nimport s".
  assert np.argmax(logits[0, tokens.shape[1] - 4]) == ord("y")


def test_corrupt_metadata_is_named_with_its_file(tmp_path):
  """A truncated config.json gave a bare JSONDecodeError; a quant.json of {} a KeyError 'model'; an unknown spec
  field a TypeError from QuantSpec. Each now names the file."""
  from moe_jax.quant import io as quant_io  # pylint: disable=g-import-not-at-top
  (tmp_path / "cfg").mkdir()
  (tmp_path / "cfg" / "config.json").write_text('{"model": ')
  with pytest.raises(ValueError, match=r"cfg/config.json is not valid JSON"):
    checkpoints.load(str(tmp_path / "cfg"))
  (tmp_path / "q").mkdir()
  (tmp_path / "q" / "quant.json").write_text("{}")
  with pytest.raises(ValueError, match=r"q/quant.json must hold the \"model\" and \"spec\" objects"):
    quant_io.load_quantized(str(tmp_path / "q"))
  model_json = checkpoints.config_to_json(checkpoints.load("tiny-trained")[0])
  (tmp_path / "q" / "quant.json").write_text(json.dumps({"model": model_json, "spec": {"fmt": "int4", "foo": 1}}))
  with pytest.raises(ValueError, match=r"spec has fields QuantSpec does not know: \['foo'\]"):
    quant_io.load_quantized(str(tmp_path / "q"))
