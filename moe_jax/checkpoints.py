"""Checkpoints: orbax for training (resumable train state), safetensors for shipped models.

Two formats, for two jobs:
  * Training: an orbax `CheckpointManager` under `workdir/checkpoints` (save every N steps, keep the last K,
    asynchronous writes). An item "state" holds the whole train state pytree (params, router biases, optimizer
    state, step) and an item "meta" (JSON) the model and train configs. Restoring gives back the exact arrays.
  * Shipping: a directory with `config.json` (the `ModelConfig` fields), `model.safetensors` (every variable of the
    model, named by its path, e.g. `blocks.0.ffn.w_gate`, stored in `config.json`'s "storage_dtype") and
    `metrics.json`. Loading casts the stored values to the config's `param_dtype` (float32 by default) with an exact
    upcast, so evaluation is deterministic.

`load("tiny-trained")` reads `moe_jax/assets/tiny-trained/`; `load(path)` reads any such directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax.config import ModelConfig

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
STORAGE_DTYPES = ("bfloat16", "float32", "float16")


# ---------------------------------------------------------------------------------------------------------------------
# Training checkpoints (orbax).

def train_manager(directory: str, *, save_every: int = 1, keep: int = 1, async_save: bool = True,
                  read_only: bool = False):
  """An orbax CheckpointManager that saves every `save_every` steps, keeps the last `keep`, writes asynchronously.

  With `read_only=True` it only restores (the directory must exist; nothing is created, saved or deleted).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  options = ocp.CheckpointManagerOptions(save_interval_steps=0 if read_only else save_every,
                                         max_to_keep=None if read_only else keep,
                                         enable_async_checkpointing=async_save, create=not read_only,
                                         read_only=read_only)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=("state", "meta"))


def train_save_args(state: dict[str, Any], meta: dict[str, Any]):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))


def restore_train_state(manager, like: dict[str, Any], step: int | None = None) -> dict[str, Any] | None:
  """The train state at `step` (default: latest) with `like`'s structure, or None if the manager holds none."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  step = manager.latest_step() if step is None else step
  if step is None:
    return None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
  return restored["state"]


def restore_train_meta(manager, step: int) -> dict[str, Any]:
  """The "meta" item saved with `step` (the train loop's {"model_config", "train_config"})."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


# ---------------------------------------------------------------------------------------------------------------------
# Shipped checkpoints (safetensors).

def _key_name(entry) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def named_variables(model: nnx.Module) -> dict[str, jax.Array]:
  """Every variable of the model (Params and router biases) by dotted path, e.g. "blocks.0.attn.wq"."""
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
  out = {}
  for path, leaf in leaves:
    names = [_key_name(k) for k in path]
    if names and names[-1] == "value":
      names = names[:-1]
    out[".".join(names)] = leaf
  return out


def config_to_json(config: ModelConfig) -> dict[str, Any]:
  d = dataclasses.asdict(config)
  d["dense_layers"] = list(d["dense_layers"])
  return d


def config_from_json(d: dict[str, Any]) -> ModelConfig:
  """The "model" dict of config.json / quant.json -> ModelConfig; every field must be there (a missing one would
  silently take a default that may not be the checkpoint's, e.g. norm_topk_prob or rope_theta)."""
  if not isinstance(d, dict):
    raise ValueError(f"the checkpoint's \"model\" entry must be a dict of ModelConfig fields, got {type(d).__name__}")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown, missing = set(d) - fields, fields - set(d)
  if unknown:
    raise ValueError(f"config.json has unknown ModelConfig fields {sorted(unknown)}")
  if missing:
    raise ValueError(f"config.json lacks ModelConfig fields {sorted(missing)} (written by another version?)")
  d = dict(d)
  d["dense_layers"] = tuple(d.get("dense_layers", ()))
  return ModelConfig(**d)


def export(model: nnx.Module, config: ModelConfig, directory: str, *, storage_dtype: str = "bfloat16",
           extra: dict[str, Any] | None = None) -> None:
  """Writes `config.json` + `model.safetensors` (values rounded to `storage_dtype`) under `directory`.

  The loaded model's config has `param_dtype="float32"` unless the config says otherwise; values are those rounded
  to `storage_dtype` (evaluate the exported model, not the training one, when recording metrics).
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top

  from moe_jax.model import Transformer  # pylint: disable=g-import-not-at-top

  if storage_dtype not in STORAGE_DTYPES:
    raise ValueError(f"storage_dtype={storage_dtype!r} must be one of {STORAGE_DTYPES}")
  if os.path.isfile(os.path.join(directory, "quant.json")):
    raise ValueError(f"{directory!r} holds a quantized checkpoint (quant.json): export to another directory")
  want = set(named_variables(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))))
  variables = named_variables(model)
  unexpected = sorted(set(variables) - want)
  if unexpected or len(want) != len(variables):  # e.g. quantized experts: `load` could not rebuild them
    raise ValueError(f"the model's variables are not those of config {config.name!r} (e.g. {unexpected[:3]}): export "
                     "writes plain models; save a quantized one with moe_jax.quant.save_quantized (or `python -m "
                     "moe_jax.quant.convert`)")
  os.makedirs(directory, exist_ok=True)
  dt = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[storage_dtype]
  tensors = {}
  for name, value in variables.items():
    arr = np.asarray(jax.device_get(value))
    tensors[name] = arr.astype(dt) if np.issubdtype(arr.dtype, np.floating) or arr.dtype == ml_dtypes.bfloat16 else arr
  # safetensors.numpy has no bfloat16: store raw uint16 bit patterns and record the real dtype.
  raw = {k: (v.view(np.uint16) if v.dtype == ml_dtypes.bfloat16 else v) for k, v in tensors.items()}
  save_file(raw, os.path.join(directory, "model.safetensors"), metadata={"storage_dtype": storage_dtype})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump({"model": config_to_json(config), "storage_dtype": storage_dtype, **(extra or {})}, f, indent=2)


def resolve(name_or_dir: str) -> str:
  """A shipped name (a directory under `moe_jax/assets/`) or a path -> the checkpoint directory."""
  if os.path.isdir(name_or_dir) and os.path.exists(os.path.join(name_or_dir, "config.json")):
    return name_or_dir
  candidate = os.path.join(ASSETS, name_or_dir)
  if os.path.exists(os.path.join(candidate, "config.json")):
    return candidate
  shipped = sorted(d for d in os.listdir(ASSETS)) if os.path.isdir(ASSETS) else []
  raise ValueError(f"checkpoint={name_or_dir!r} is neither a checkpoint directory (with config.json) nor a shipped "
                   f"checkpoint; shipped: {shipped}. A training --workdir or a moe_jax.quant.convert --out directory "
                   "is read by moe_jax.cli.load_checkpoint (every --checkpoint flag), or export the run with "
                   "`python -m moe_jax.train ... --export=DIR`")


def load(name_or_dir: str, *, param_dtype: str | None = None,
         moe_implementation: str = "xla") -> tuple[ModelConfig, nnx.Module]:
  """Loads a shipped checkpoint: `load("tiny-trained")` or `load("/path/to/dir")` -> (config, model).

  Args:
    name_or_dir: shipped name or directory holding config.json + model.safetensors.
    param_dtype: override the config's parameter dtype (default: as recorded, float32 for tiny-trained).
    moe_implementation: grouped-matmul implementation for the MoE layers.
  """
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  from moe_jax.model import Transformer  # pylint: disable=g-import-not-at-top

  directory = resolve(name_or_dir)
  path = os.path.join(directory, "config.json")
  meta = read_json(path)
  if not isinstance(meta, dict) or "model" not in meta:
    hint = (" (a Hugging Face checkpoint: load it with --hf / moe_jax.hf)" if isinstance(meta, dict)
            and "model_type" in meta else "")
    raise ValueError(f"{path} has no \"model\" entry: not a directory written by checkpoints.export{hint}")
  config = config_from_json(meta["model"])
  if param_dtype is not None:
    config = config.replace(param_dtype=param_dtype)
  weights = os.path.join(directory, "model.safetensors")
  with safe_open(weights, framework="numpy") as f:  # export records the dtype in the file too: it wins
    storage = (f.metadata() or {}).get("storage_dtype", meta.get("storage_dtype", "float32"))
  if storage not in STORAGE_DTYPES:
    raise ValueError(f"{weights}: storage_dtype={storage!r} must be one of {STORAGE_DTYPES}")
  tensors = load_file(weights)
  # Abstract init (shapes only, no random draws), then every variable is filled from the file.
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), moe_implementation=moe_implementation))
  state = nnx.state(model)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = list(named_variables(model))
  missing = sorted(set(names) - set(tensors))
  extra = sorted(set(tensors) - set(names))
  if missing or extra:
    raise ValueError(f"checkpoint {directory} does not match config {config.name!r}: missing {missing[:5]}, "
                     f"unexpected {extra[:5]}")
  new_leaves = []
  for name, (_, leaf) in zip(names, leaves):
    arr = tensors[name]
    if storage == "bfloat16" and arr.dtype == np.uint16:
      arr = arr.view(ml_dtypes.bfloat16)
    elif not np.issubdtype(arr.dtype, np.floating) and jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(f"{name}: stored as {arr.dtype} under storage_dtype={storage!r}, but the model's variable is "
                       f"{leaf.dtype} (bfloat16 bit patterns need storage_dtype='bfloat16')")
    if arr.shape != leaf.shape:
      raise ValueError(f"{name}: checkpoint shape {arr.shape} != model shape {leaf.shape}")
    new_leaves.append(jnp.asarray(arr.astype(np.float32)).astype(leaf.dtype)
                      if arr.dtype != leaf.dtype else jnp.asarray(arr))
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, new_leaves))
  return config, model


def read_json(path: str) -> Any:
  """The JSON in `path`; ValueError naming the file where it is not JSON (a truncated write, say)."""
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON ({e})") from None


def recorded_metrics(name_or_dir: str) -> dict[str, Any]:
  """The `metrics.json` shipped beside a checkpoint ({} if none)."""
  path = os.path.join(resolve(name_or_dir), "metrics.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)
