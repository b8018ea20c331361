"""Orbax save / restore of a model whose experts are quantized.

A quantized checkpoint directory holds `quant.json` (the `ModelConfig`, the quantization spec, the source checkpoint,
expert bytes) and `params/`, an orbax StandardCheckpointer item with the model's whole state as a pure dict
(quantized experts as their raw arrays). Restoring rebuilds the quantized structure with `jax.eval_shape` (no
calibration or k-means runs) and reads the arrays into it. The Mosaic GPU layouts (`to_mgpu_layout`: kinds
int4_mgpu, int4_mgpu_gate_up, vq2_mgpu) are not stored: save the int4 / vq2 model and convert after `load_quantized`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from flax import nnx

from moe_jax import checkpoints
from moe_jax.config import ModelConfig
from moe_jax.quant.experts import QuantSpec, expert_bytes, expert_weights, quantize_experts
from moe_jax.quant.formats import MGPU_KINDS


def save_quantized(model, config: ModelConfig, spec: QuantSpec, directory: str, *, source: str = "") -> str:
  """Writes `directory/quant.json` and `directory/params` (orbax); returns the directory."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  for name, w in expert_weights(model).items():  # load_quantized rebuilds `spec`'s kinds, not to_mgpu_layout's
    if getattr(w, "kind", None) in MGPU_KINDS:
      raise ValueError(f"{name}: save_quantized stores the int4 / vq2 layout that load_quantized rebuilds, not "
                       f"quant.to_mgpu_layout's {w.kind!r}; save before to_mgpu_layout and convert after loading")
  # What load_quantized will rebuild from `spec`: the model must have that structure, or the directory is unreadable.
  from moe_jax.model import Transformer  # pylint: disable=g-import-not-at-top
  want = nnx.eval_shape(lambda: quantize_experts(Transformer(config, rngs=nnx.Rngs(0)), spec, calib="structure"))
  have_w, want_w = expert_weights(model), expert_weights(want)
  for name in sorted(set(have_w) | set(want_w)):
    a, b = have_w.get(name), want_w.get(name)
    if getattr(a, "kind", "unquantized") != getattr(b, "kind", "unquantized") or \
        jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
      raise ValueError(f"{name} is {getattr(a, 'kind', 'unquantized')!r} but spec={spec} rebuilds "
                       f"{getattr(b, 'kind', 'unquantized')!r}: save the model with the spec it was quantized with")
  paths = lambda m: {jax.tree_util.keystr(p) for p, _ in  # noqa: E731
                     jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(m)))[0]}
  extra, missing = sorted(paths(model) - paths(want)), sorted(paths(want) - paths(model))
  if extra or missing:  # e.g. an LCVC-routed model's penalty, threshold and surrogates (before: saved, then unloadable)
    raise ValueError(f"the model's state differs from what load_quantized rebuilds (extra {extra[:3]}, missing "
                     f"{missing[:3]}): save the plain quantized model, before locality.make_lcvc / with_lcvc")

  directory = check_out_dir(directory)
  os.makedirs(directory, exist_ok=True)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(directory, "params"), nnx.to_pure_dict(nnx.state(model)), force=True)
  ckpt.wait_until_finished()
  meta = {"model": checkpoints.config_to_json(config), "spec": dataclasses.asdict(spec), "source": source,
          "expert_bytes": expert_bytes(model)}
  with open(os.path.join(directory, "quant.json"), "w") as f:
    json.dump(meta, f, indent=2)
  return directory


def check_out_dir(directory: str) -> str:
  """The absolute path `save_quantized` writes to, after refusing by name: an empty path (it was the working
  directory), a file, an exported checkpoint's directory (`--checkpoint` would load that model instead) and a
  `params/` that no `save_quantized` wrote (no quant.json beside it: orbax's forced save replaced it)."""
  if not directory:
    raise ValueError("out='' names no directory (it was taken as the working directory)")
  directory = os.path.abspath(directory)
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"out={directory!r} is a file, not a directory")
  if os.path.isfile(os.path.join(directory, "config.json")):
    raise ValueError(f"{directory!r} holds an exported checkpoint (config.json): save the quantized one in another "
                     "directory")
  if os.path.exists(os.path.join(directory, "params")) and not os.path.isfile(os.path.join(directory, "quant.json")):
    raise ValueError(f"{directory!r} has a params/ that no save_quantized wrote (no quant.json): it would be "
                     "replaced; choose another directory")
  return directory


def load_quantized(directory: str, *, moe_implementation: str = "xla"):
  """Reads a directory written by `save_quantized` -> (config, model, spec)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from moe_jax.model import Transformer  # pylint: disable=g-import-not-at-top

  directory = os.path.abspath(directory)
  if not os.path.isfile(os.path.join(directory, "quant.json")):
    raise ValueError(f"{directory!r} is not a directory written by save_quantized (no quant.json)")
  path = os.path.join(directory, "quant.json")
  meta = checkpoints.read_json(path)
  if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict) or not isinstance(meta.get("spec"), dict):
    raise ValueError(f"{path} must hold the \"model\" and \"spec\" objects save_quantized writes")
  config = checkpoints.config_from_json(meta["model"])
  unknown = sorted(set(meta["spec"]) - {f.name for f in dataclasses.fields(QuantSpec)})
  if unknown:
    raise ValueError(f"{path}: spec has fields QuantSpec does not know: {unknown}")
  spec = QuantSpec(**meta["spec"])
  model = nnx.eval_shape(lambda: quantize_experts(
      Transformer(config, rngs=nnx.Rngs(0), moe_implementation=moe_implementation), spec, calib="structure"))
  state = nnx.state(model)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
  restored = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), target)
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(model, state)
  return config, model, spec
