"""The command-line tools' shared setup (`moe_jax.cli`): every --checkpoint form loads (shipped, quantized by
`moe_jax.quant.convert`, a training workdir), and --kv_cache=oskvp_static is calibrated at start."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moe_jax import checkpoints, cli, decode, quant, train
from moe_jax.quant import convert


def test_a_converted_quantized_checkpoint_loads_through_the_cli_loader(tiny_model, tiny_config, tmp_path):
  # The user's path: an exported checkpoint -> `quant.convert --expert_quant=int4 --out=DIR` -> --checkpoint=DIR.
  checkpoints.export(tiny_model, tiny_config, str(tmp_path / "f32"), storage_dtype="float32")
  convert.convert(str(tmp_path / "f32"), "int4", str(tmp_path / "int4"))
  assert cli.checkpoint_kind(str(tmp_path / "int4")) == "quantized"
  config, model = cli.load_checkpoint(str(tmp_path / "int4"))
  assert config == tiny_config
  assert {w.kind for w in quant.expert_weights(model).values()} == {"int4"}
  in_memory = quant.quantize_experts(nnx.clone(tiny_model), "int4")
  probe = jnp.asarray([[257, 5, 17, 99, 3, 42]], jnp.int32)
  # Tolerance 0: the restored arrays are the in-memory quantization's, through the same program.
  np.testing.assert_array_equal(np.asarray(decode.logits(model, probe)), np.asarray(decode.logits(in_memory, probe)))
  # Converting into the exported directory itself is refused (before: it succeeded, and --checkpoint=DIR then loaded
  # the unquantized model from config.json); a directory that holds both files anyway is named as ambiguous.
  with pytest.raises(ValueError, match="holds an exported checkpoint"):
    convert.convert(str(tmp_path / "f32"), "int4", str(tmp_path / "f32"))
  with pytest.raises(ValueError, match="holds a quantized checkpoint"):
    checkpoints.export(tiny_model, tiny_config, str(tmp_path / "int4"))
  (tmp_path / "int4" / "config.json").write_text((tmp_path / "f32" / "config.json").read_text())
  with pytest.raises(ValueError, match="holds both config.json .* and quant.json"):
    cli.load_checkpoint(str(tmp_path / "int4"))


def test_a_training_workdir_loads_its_latest_step(tiny_config, tmp_path):
  config = tiny_config.replace(n_layers=1, name="tiny-1block")
  tc = train.TrainConfig(steps=2, batch_size=2, seq_len=32, warmup=1, save_every=1, keep=1, log_every=1,
                         eval_windows=1)
  train.train(config, tc, str(tmp_path / "run"), progress=False, export_dir=str(tmp_path / "exported"))
  assert cli.checkpoint_kind(str(tmp_path / "run")) == "workdir"
  loaded_config, model = cli.load_checkpoint(str(tmp_path / "run"))
  assert loaded_config == config
  # The workdir holds the exact float32 train state; --export wrote the same values rounded to bf16.
  _, exported = checkpoints.load(str(tmp_path / "exported"))
  got = checkpoints.named_variables(model)
  for name, x in checkpoints.named_variables(exported).items():
    assert got[name].dtype == jnp.float32, name
    np.testing.assert_array_equal(np.asarray(got[name]).astype(ml_dtypes.bfloat16).astype(np.float32),
                                  np.asarray(x), err_msg=name)
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(ValueError, match="holds no checkpoint yet"):
    cli.load_checkpoint(str(tmp_path / "empty"))


def test_an_unknown_checkpoint_names_the_flag_and_the_accepted_forms(tmp_path):
  for bad in ("nope", str(tmp_path)):
    with pytest.raises(ValueError, match=r"--checkpoint=.* config\.json \(train --export=DIR.*quant\.json.*"
                                         r"checkpoints/ \(a moe_jax\.train --workdir\)"):
      cli.load_checkpoint(bad)
  with pytest.raises(ValueError, match="at most one of --hf and --checkpoint"):
    cli.load_model(checkpoint="tiny-trained", hf=str(tmp_path))


@pytest.fixture
def static_mode_restored(monkeypatch):
  """The uncalibrated `oskvp_static` is put back after the test (and the prefills compiled with the calibrated one
  are dropped)."""
  from moe_jax.kv_cache import KV_CACHE_MODES, get_kv_cache_mode  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(KV_CACHE_MODES, "oskvp_static", get_kv_cache_mode("oskvp_static"))
  yield KV_CACHE_MODES
  jax.clear_caches()


def test_cli_setup_calibrates_oskvp_static(tiny_config, static_mode_restored, capsys):
  registry = static_mode_restored
  assert registry["oskvp_static"].params_k is None
  flags_ = types.SimpleNamespace(checkpoint=None, hf=None, config="tiny", seed=0, kv_cache="oskvp_static",
                                 kv_calib_windows=1)
  config, model, _ = cli.from_flags(flags_)
  assert config == tiny_config
  out = capsys.readouterr().out.splitlines()
  assert out == [f"kv_cache=oskvp_static: calibrating per-(layer, kv head) OS-KVP on 1 training-split windows of "
                 f"{tiny_config.max_seq_len} tokens (--kv_calib_windows)"]
  mode = registry["oskvp_static"]
  c = tiny_config
  assert mode.params_k.u.shape == (c.n_layers, c.n_kv_heads, c.head_dim, c.head_dim)
  assert mode.params_v.codebook.shape == (c.n_layers, c.n_kv_heads, c.head_dim, 4)
  # Decoding through it works now (before: "not calibrated") and every sequence carries the calibrated basis.
  _, cache = decode.prefill(model, jnp.ones((1, 8), jnp.int32), jnp.array([8]), kv_cache="oskvp_static",
                            cache_len=16)
  np.testing.assert_array_equal(cache.layers[1].u_k[0], mode.params_k.u[1])
  # Calibrated once: a second setup (or any other mode) does nothing.
  assert cli.setup_kv_cache(model, "oskvp_static", log=pytest.fail) is None
  assert cli.setup_kv_cache(model, "int8", log=pytest.fail) is None
  with pytest.raises(ValueError, match="kv_cache='int3'"):
    cli.setup_kv_cache(model, "int3")


def test_oskvp_static_calibrates_an_hf_model_on_its_own_token_ids(static_mode_restored, monkeypatch):
  """--hf with --kv_cache=oskvp_static: the training split's text tokenized by the model's tokenizer (before: byte
  ids, which a 128-token vocabulary refused and a larger one took as other tokens)."""
  from moe_jax import data  # pylint: disable=g-import-not-at-top
  from moe_jax.kv_quant import static  # pylint: disable=g-import-not-at-top
  seen = {}
  calibrate = static.calibrate_model
  monkeypatch.setattr(static, "calibrate_model", lambda m, tokens, **kw: calibrate(m, seen.setdefault("t", tokens),
                                                                                    **kw))
  config, model, tok = cli.load_model(checkpoint=None, hf="tests/fixtures/hf/mixtral")
  assert cli.setup_kv_cache(model, "oskvp_static", calib_windows=2, calib_seq_len=48, tokenizer=tok,
                            log=lambda s: None).params_k is not None
  tokens = np.asarray(seen["t"])
  assert tokens.shape == (2, 48) and tokens.max() < config.vocab_size
  # Window 0 starts the split: its first 8 · 48 bytes (file starts as newlines) through the tokenizer.
  split = data.load_corpus()["train"].tokens[:static.BYTES_PER_TOKEN * 48]
  text = np.where(split == 257, 10, split).astype(np.uint8).tobytes().decode("utf-8", "replace")
  np.testing.assert_array_equal(tokens[0], tok.encode(text)[:48])
