"""What the command-line tools share: the model a `--checkpoint` / `--hf` / `--config` flag names, and the KV cache
mode prepared for `--kv_cache`.

Every `--checkpoint=` flag (eval, generate, batch_decode, serve_bench, serving.server) takes, through
`load_checkpoint`:
  * a shipped name (`tiny-trained`) or a directory with `config.json` (`moe_jax.checkpoints.export`,
    `python -m moe_jax.train ... --export=DIR`), read by `moe_jax.checkpoints.load`;
  * a directory with `quant.json` (`python -m moe_jax.quant.convert ... --out=DIR`), read by
    `moe_jax.quant.load_quantized` (routed experts stay quantized);
  * a training workdir with `checkpoints/` (`python -m moe_jax.train --workdir=DIR`): its latest step's exact float32
    parameters with the run's config (`moe_jax.train.load_workdir`).

`setup_kv_cache` calibrates `kv_cache=oskvp_static` (per-(layer, kv head) OS-KVP, `moe_jax.kv_quant.static`) on
training-split windows when it has no calibration yet; other modes need nothing.

This module sits above the library (it imports `moe_jax.quant` and `moe_jax.train` when a flag asks for them); the
library modules do not import it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

from moe_jax.config import ModelConfig

CALIB_WINDOWS = 16  # oskvp_static calibration: windows of the training split (as moe_jax.kv_quant.report)
CALIB_SEQ_LEN = 1024  # tokens per calibration window (at most the model's max_seq_len)


def checkpoint_kind(name_or_dir: str) -> str:
  """"shipped" (a shipped name or a directory with config.json), "quantized" (quant.json) or "workdir"
  (checkpoints/); ValueError naming --checkpoint and the accepted forms otherwise."""
  from moe_jax import checkpoints  # pylint: disable=g-import-not-at-top

  if os.path.isdir(name_or_dir):
    found = [f for f in ("config.json", "quant.json") if os.path.isfile(os.path.join(name_or_dir, f))]
    if len(found) == 2:
      raise ValueError(f"--checkpoint={name_or_dir!r} holds both config.json (an exported model) and quant.json (a "
                       "quantized one): which to load is ambiguous; keep them in separate directories")
    if found:
      return {"config.json": "shipped", "quant.json": "quantized"}[found[0]]
    if os.path.isdir(os.path.join(name_or_dir, "checkpoints")):
      return "workdir"
  elif os.path.isfile(os.path.join(checkpoints.ASSETS, name_or_dir, "config.json")):
    return "shipped"
  shipped = sorted(os.listdir(checkpoints.ASSETS)) if os.path.isdir(checkpoints.ASSETS) else []
  raise ValueError(f"--checkpoint={name_or_dir!r} is not a shipped checkpoint ({shipped}) nor a directory holding "
                   "config.json (train --export=DIR, checkpoints.export), quant.json (moe_jax.quant.convert --out=DIR) "
                   "or checkpoints/ (a moe_jax.train --workdir)")


@contextlib.contextmanager
def _orbax_quiet():
  """absl logging at WARNING while orbax reads (it logs every restore at INFO, which app.run shows)."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  level = logging.get_verbosity()
  logging.set_verbosity(min(level, logging.WARNING))  # absl: larger is more verbose
  try:
    yield
  finally:
    logging.set_verbosity(level)


def load_checkpoint(name_or_dir: str, *, moe_implementation: str = "xla") -> tuple[ModelConfig, Any]:
  """The model a `--checkpoint` flag names -> (config, model); see the module docstring for the accepted forms."""
  kind = checkpoint_kind(name_or_dir)
  if kind == "quantized":
    from moe_jax import quant  # pylint: disable=g-import-not-at-top
    with _orbax_quiet():
      config, model, _ = quant.load_quantized(name_or_dir, moe_implementation=moe_implementation)
    return config, model
  if kind == "workdir":
    from moe_jax import train  # pylint: disable=g-import-not-at-top
    if moe_implementation != "xla":
      raise ValueError(f"moe_implementation={moe_implementation!r}: a training workdir loads with 'xla' only")
    with _orbax_quiet():
      return train.load_workdir(name_or_dir)
  from moe_jax import checkpoints  # pylint: disable=g-import-not-at-top
  return checkpoints.load(name_or_dir, moe_implementation=moe_implementation)


def load_model(*, checkpoint: str | None = None, hf: str | None = None, config: str | None = "tiny",
               seed: int = 0) -> tuple[ModelConfig, Any, Any]:
  """(config, model, tokenizer) from `--hf`, else `--checkpoint`, else the `--config` preset (random weights)."""
  from moe_jax.tokenizer import ByteTokenizer  # pylint: disable=g-import-not-at-top

  if hf and checkpoint:
    raise ValueError("give at most one of --hf and --checkpoint")
  if hf:
    from moe_jax import hf as hf_lib  # pylint: disable=g-import-not-at-top
    model_config, model = hf_lib.load(hf)
    return model_config, model, hf_lib.load_tokenizer(hf)
  if checkpoint:
    model_config, model = load_checkpoint(checkpoint)
    return model_config, model, ByteTokenizer()
  import configs  # pylint: disable=g-import-not-at-top
  from moe_jax import decode  # pylint: disable=g-import-not-at-top
  model_config = configs.get(config, flag="--config")
  return model_config, decode.init_model(model_config, seed=seed), ByteTokenizer()


def setup_kv_cache(model, kv_cache: str, *, calib_windows: int = CALIB_WINDOWS, calib_seq_len: int = CALIB_SEQ_LEN,
                   tokenizer=None, log: Callable[[str], None] = print):
  """Makes `--kv_cache=kv_cache` usable with `model`; returns the mode it installed, or None when none was needed.

  An unknown name raises ValueError naming kv_cache. `oskvp_static` without a calibration for this model's shapes
  is calibrated here (`moe_jax.kv_quant.static.calibrate_on_training_split`: `calib_windows` training-split windows
  of min(calib_seq_len, max_seq_len) tokens, one line logged) and installed under its name. `tokenizer`: the model's
  (`load_model`'s third value); a Hugging Face one tokenizes the split's text (byte ids would be other tokens).
  """
  from moe_jax.kv_cache import get_kv_cache_mode  # pylint: disable=g-import-not-at-top

  mode = get_kv_cache_mode(kv_cache)
  from moe_jax.kv_quant import static  # pylint: disable=g-import-not-at-top
  from moe_jax.kv_quant.oskvp_modes import StaticOSKVPMode  # pylint: disable=g-import-not-at-top

  if not isinstance(mode, StaticOSKVPMode) or (mode.params_k is not None and mode.matches(model.config)):
    return None  # (a calibration installed for another model is replaced)
  if not isinstance(calib_windows, int) or calib_windows < 1:
    raise ValueError(f"--kv_calib_windows={calib_windows!r} must be an int >= 1")
  seq_len = min(calib_seq_len, model.config.max_seq_len)
  log(f"kv_cache={kv_cache}: calibrating per-(layer, kv head) OS-KVP on {calib_windows} training-split windows of "
      f"{seq_len} tokens (--kv_calib_windows)")
  calibrated = static.calibrate_on_training_split(model, n_windows=calib_windows, seq_len=seq_len,
                                                  window=mode.window, implementation=mode.implementation,
                                                  tokenizer=tokenizer)
  static.install(calibrated, name=kv_cache)
  return calibrated


def define_kv_calib_windows() -> None:
  """Defines `--kv_calib_windows` (absl) for the tool being run, which takes `--kv_cache`."""
  import sys  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_integer("kv_calib_windows", CALIB_WINDOWS, "Training-split windows that calibrate "
                       "--kv_cache=oskvp_static.", module_name=sys.argv[0])  # listed by the tool's --helpshort


def from_flags(flags_) -> tuple[ModelConfig, Any, Any]:
  """The command-line tools' setup: (config, model, tokenizer) from --hf / --checkpoint / --config [--seed], with
  --kv_cache prepared (`setup_kv_cache`, --kv_calib_windows) when the tool has that flag."""
  config, model, tokenizer = load_model(checkpoint=getattr(flags_, "checkpoint", None), hf=getattr(flags_, "hf", None),
                                        config=getattr(flags_, "config", "tiny"), seed=getattr(flags_, "seed", 0))
  kv_cache = getattr(flags_, "kv_cache", None)
  if kv_cache:
    setup_kv_cache(model, kv_cache, calib_windows=getattr(flags_, "kv_calib_windows", CALIB_WINDOWS),
                   tokenizer=tokenizer)
  return config, model, tokenizer
