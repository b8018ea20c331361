"""Evaluation harness: validation bits per byte through the real decode path, and agreement with the baseline.

`python -m moe_jax.eval --checkpoint=NAME_OR_DIR [--kv_cache=MODE] [--expert_quant=MODE] [--routing=MODE] [--json]`
(`--checkpoint`: anything `moe_jax.cli.load_checkpoint` reads; `--kv_cache=oskvp_static` is calibrated at start on
`--kv_calib_windows` training-split windows, `moe_jax.cli.setup_kv_cache`).

What is measured, on `n_windows` validation windows of the stdlib corpus (`moe_jax.data`, evenly spaced, so the
numbers are deterministic on a given Python's stdlib):
  * each window holds `context + 1` tokens; `moe_jax.decode.prefill` runs the first `prefix` tokens and builds the
    KV cache in mode `kv_cache` (compressed modes compress here), then `decode_step` feeds the true tokens one at a
    time (teacher forcing), so every scored prediction after the first reads the cache, its compression included;
  * scored targets: tokens `prefix .. context` of each window (the first from prefill's last logits, the other
    `context - prefix` from decode steps): `context - prefix + 1` predictions per window;
  * bits per byte = mean over scored targets of -log2 p(target) (tokens are bytes; a file-start BOS target counts
    as one byte);
  * agreement = fraction of scored positions where the variant's argmax equals the baseline's; KL = mean over
    positions of KL(baseline ‖ variant) in nats. The baseline is the same model with the `bf16` cache, original
    experts and default routing; a variant equal to the baseline reports agreement 1 and KL 0 by construction.

Modes: `kv_cache` names come from `moe_jax.kv_cache.get_kv_cache_mode`. `EXPERT_QUANT_MODES` and `ROUTING_MODES`
map a name to `fn(model) -> model` (the function gets a clone and may modify it); `moe_jax.quant` and
`moe_jax.routing_modes` fill them on import, which `evaluate` attempts lazily. Unknown names raise ValueError naming the
flag.
"""

from __future__ import annotations

import functools
import importlib
import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax import data as data_lib
from moe_jax import decode
from moe_jax.config import ModelConfig
from moe_jax.kv_cache import KV_CACHE_MODES, get_kv_cache_mode

ModelTransform = Callable[[nnx.Module], nnx.Module]

# name -> fn(model) -> model. Filled by the modules that implement the modes (on import).
EXPERT_QUANT_MODES: dict[str, ModelTransform] = {}
ROUTING_MODES: dict[str, ModelTransform] = {}

# Modules that register modes in the registries above when imported.
_PROVIDERS = {"expert_quant": ("moe_jax.quant",), "routing": ("moe_jax.locality", "moe_jax.routing_modes")}

BASELINE = {"kv_cache": "bf16", "expert_quant": "none", "routing": "default"}
DEFAULTS = {"n_windows": 8, "context": 256, "prefix": 64}


def _lookup(flag: str, name: str, registry: dict[str, ModelTransform]) -> ModelTransform | None:
  if name in (None, "", BASELINE[flag]):
    return None
  if name not in registry:
    for module in _PROVIDERS[flag]:
      try:
        importlib.import_module(module)
      except ImportError:
        pass
  if name not in registry:
    raise ValueError(f"{flag}={name!r} is not a known mode; choose one of "
                     f"{sorted([BASELINE[flag], *registry])}")
  return registry[name]


def available_modes() -> dict[str, list[str]]:
  """Every mode name each flag accepts now (after importing the providers)."""
  for modules in _PROVIDERS.values():
    for module in modules:
      try:
        importlib.import_module(module)
      except ImportError:
        pass
  try:
    importlib.import_module("moe_jax.kv_quant")  # registers the compressed cache modes
  except ImportError:
    pass
  return {"kv_cache": sorted(KV_CACHE_MODES), "expert_quant": ["none", *sorted(EXPERT_QUANT_MODES)],
          "routing": ["default", *sorted(ROUTING_MODES)]}


@functools.partial(jax.jit, static_argnames=("prefix", "kv_cache", "cache_len"))
def teacher_forced_logprobs(model, windows: jax.Array, *, prefix: int, kv_cache: str, cache_len: int):
  """windows: int32 [B, L+1] -> (float32 log-probs [B, L+1-prefix, V] of targets windows[:, prefix:], final cache).

  One jit: prefill of the prefix, then a scan of decode steps over the true tokens.
  """
  b = windows.shape[0]
  lengths = jnp.full((b,), prefix, jnp.int32)
  logits0, cache = decode.prefill(model, windows[:, :prefix], lengths, kv_cache=kv_cache, cache_len=cache_len,
                                  last_only=True)  # [B, V] at position prefix - 1
  inputs = windows[:, prefix:-1].T  # [L - prefix, B], token fed at each step

  def body(cache, tok):
    out, cache = decode.decode_step(model, cache, tok)  # [B, V]
    return cache, jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)

  cache, steps = jax.lax.scan(body, cache, inputs)  # [L - prefix, B, V]
  first = jax.nn.log_softmax(logits0.astype(jnp.float32), axis=-1)  # [B, V]
  logp = jnp.concatenate([first[:, None], jnp.swapaxes(steps, 0, 1)], axis=1)
  return logp, cache


def bits_per_byte(logp: np.ndarray, targets: np.ndarray) -> float:
  """logp float32 [B, T, V] log-probs, targets int [B, T] -> mean -log2 p(target): bits per byte (byte tokens)."""
  return float(-np.mean(np.take_along_axis(logp, targets[..., None], axis=-1)) / np.log(2.0))


def evaluate(model: nnx.Module, config: ModelConfig, *, kv_cache: str = "bf16", expert_quant: str = "none",
             routing: str = "default", n_windows: int = DEFAULTS["n_windows"], context: int = DEFAULTS["context"],
             prefix: int = DEFAULTS["prefix"], windows: np.ndarray | None = None) -> dict[str, Any]:
  """Bits per byte of a variant of `model` through prefill + teacher-forced decode, and its agreement with baseline.

  Args:
    model: the Transformer (not modified).
    config: its config (for max_seq_len).
    kv_cache: KV cache mode name.
    expert_quant: a key of `EXPERT_QUANT_MODES` or "none".
    routing: a key of `ROUTING_MODES` or "default".
    n_windows: validation windows (the batch).
    context: tokens per window fed to the model; predictions are scored for positions prefix..context.
    prefix: tokens prefilled before decoding starts (1 <= prefix <= context).
    windows: int32 [W, context + 1] to use instead of the validation split (tests).

  Returns:
    dict with the settings, "bpb", "baseline_bpb", "agreement", "kl" (nats), "scored_tokens", "kv_cache_bytes",
    "seconds".
  """
  get_kv_cache_mode(kv_cache)  # clear error before any work
  quant_fn = _lookup("expert_quant", expert_quant, EXPERT_QUANT_MODES)
  routing_fn = _lookup("routing", routing, ROUTING_MODES)
  if not 1 <= prefix <= context:
    raise ValueError(f"prefix={prefix} must be in [1, context={context}]")
  if windows is None and (not isinstance(n_windows, int) or n_windows < 1):
    raise ValueError(f"n_windows={n_windows!r} must be an int >= 1")
  if context > config.max_seq_len:  # the model is fed `context` tokens (the last of a window is only a target)
    raise ValueError(f"context={context} exceeds max_seq_len={config.max_seq_len} of {config.name!r}")
  if windows is None:
    val = data_lib.load_corpus()["validation"].tokens
    windows = data_lib.eval_windows(val, n_windows=n_windows, seq_len=context)
  windows = np.asarray(windows)
  if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] != context + 1:
    raise ValueError(f"windows must be [W >= 1, context + 1 = {context + 1}], got {windows.shape}")
  if not np.issubdtype(windows.dtype, np.integer):
    raise ValueError(f"windows must hold integer token ids, got dtype {windows.dtype}")
  try:  # -1 would score the last vocabulary entry (numpy indexing), an id past it fail after the model ran
    decode.check_token_ids(config, windows)
  except ValueError as e:
    raise ValueError(f"windows: {e}") from e
  windows = windows.astype(np.int32)
  targets = windows[:, prefix:]
  cache_len = context

  t0 = time.time()
  base_logp, base_cache = teacher_forced_logprobs(model, jnp.asarray(windows), prefix=prefix,
                                                   kv_cache=BASELINE["kv_cache"], cache_len=cache_len)
  base_logp, base_bytes = np.asarray(base_logp), base_cache.nbytes()
  is_baseline = quant_fn is None and routing_fn is None and kv_cache == BASELINE["kv_cache"]
  if is_baseline:
    logp, nbytes = base_logp, base_bytes
  else:
    variant = nnx.clone(model)
    if quant_fn is not None:
      variant = quant_fn(variant)
    if routing_fn is not None:
      variant = routing_fn(variant)
    logp, cache = teacher_forced_logprobs(variant, jnp.asarray(windows), prefix=prefix, kv_cache=kv_cache,
                                           cache_len=cache_len)
    logp, nbytes = np.asarray(logp), cache.nbytes()
  p_base = np.exp(base_logp)
  kl = float(np.mean(np.sum(p_base * (base_logp - logp), axis=-1)))
  agreement = float(np.mean(np.argmax(logp, -1) == np.argmax(base_logp, -1)))
  return {
      "model": config.name, "kv_cache": kv_cache, "expert_quant": expert_quant, "routing": routing,
      "n_windows": int(windows.shape[0]), "context": context, "prefix": prefix,
      "scored_tokens": int(targets.size),
      "bpb": bits_per_byte(logp, targets), "baseline_bpb": bits_per_byte(base_logp, targets),
      "agreement": agreement, "kl": kl,
      "kv_cache_bytes": int(nbytes), "seconds": time.time() - t0,
  }


def forward_bits_per_byte(model: nnx.Module, *, n_windows: int = 64, seq_len: int = 512,
                          batch: int = 8) -> float:
  """Validation bits per byte of the full causal forward (no cache) over `n_windows` windows of `seq_len + 1`."""
  val = data_lib.load_corpus()["validation"].tokens
  windows = data_lib.eval_windows(val, n_windows=n_windows, seq_len=seq_len)
  total = 0.0
  for i in range(0, n_windows, batch):
    w = windows[i:i + batch]
    logp = jax.nn.log_softmax(decode.logits(model, jnp.asarray(w[:, :-1])), axis=-1)
    total += float(-jnp.sum(jnp.take_along_axis(logp, jnp.asarray(w[:, 1:, None]), axis=-1)))
  return total / (n_windows * seq_len) / np.log(2.0)


def record_metrics(name_or_dir: str) -> dict[str, Any]:
  """Measures a checkpoint on this machine's stdlib and writes `metrics.json` beside it (what the tests check)."""
  import os  # pylint: disable=g-import-not-at-top
  import platform  # pylint: disable=g-import-not-at-top
  from moe_jax import checkpoints  # pylint: disable=g-import-not-at-top

  config, model = checkpoints.load(name_or_dir)
  corpus = data_lib.load_corpus()
  metrics = {
      "python": platform.python_version(), "corpus": data_lib.describe(corpus),
      "unigram_bpb": data_lib.unigram_bits_per_byte(corpus["train"].tokens, corpus["validation"].tokens),
      "forward_bpb": forward_bits_per_byte(model), "forward_windows": 64, "forward_seq_len": 512,
      "decode_eval": evaluate(model, config),
      "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
  }
  with open(os.path.join(checkpoints.resolve(name_or_dir), "metrics.json"), "w") as f:
    json.dump(metrics, f, indent=2)
  return metrics


def markdown(result: dict[str, Any]) -> str:
  keys = ["model", "kv_cache", "expert_quant", "routing", "context", "prefix", "n_windows", "scored_tokens", "bpb",
          "baseline_bpb", "agreement", "kl", "kv_cache_bytes"]
  fmt = lambda k, v: (f"{v:.2e}" if k == "kl" else f"{v:.4f}") if isinstance(v, float) else str(v)  # small KLs
  return ("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n| "
          + " | ".join(fmt(k, result[k]) for k in keys) + " |")


def main(argv):
  del argv
  from absl import flags as absl_flags  # pylint: disable=g-import-not-at-top
  from moe_jax import cli  # pylint: disable=g-import-not-at-top

  f = absl_flags.FLAGS
  if f.record:  # the checkpoint's metrics.json is measured with the defaults; another setting would be dropped
    given = [name for name in ("kv_cache", "kv_calib_windows", "expert_quant", "routing", "n_windows", "context",
                               "prefix", "json") if f[name].present]
    if given:
      raise ValueError(f"--record measures the checkpoint with the defaults; drop --{', --'.join(given)}")
    print(json.dumps(record_metrics(f.checkpoint), indent=2))
    return
  config, model = cli.load_checkpoint(f.checkpoint)
  cli.setup_kv_cache(model, f.kv_cache, calib_windows=f.kv_calib_windows)
  result = evaluate(model, config, kv_cache=f.kv_cache, expert_quant=f.expert_quant, routing=f.routing,
                    n_windows=f.n_windows, context=f.context, prefix=f.prefix)
  result["checkpoint"] = f.checkpoint
  print(json.dumps(result, indent=2) if f.json else markdown(result))


if __name__ == "__main__":
  from absl import app, flags

  from moe_jax import cli

  flags.DEFINE_string("checkpoint", "tiny-trained", "Shipped checkpoint name, checkpoint directory, quantized "
                      "directory (moe_jax.quant.convert --out) or training --workdir (moe_jax.cli.load_checkpoint).")
  flags.DEFINE_string("kv_cache", "bf16", "KV cache mode (moe_jax.kv_cache / moe_jax.kv_quant).")
  cli.define_kv_calib_windows()
  flags.DEFINE_string("expert_quant", "none", "Expert weight quantization mode (EXPERT_QUANT_MODES).")
  flags.DEFINE_string("routing", "default", "Routing mode (ROUTING_MODES).")
  flags.DEFINE_integer("n_windows", DEFAULTS["n_windows"], "Validation windows.")
  flags.DEFINE_integer("context", DEFAULTS["context"], "Tokens fed per window.")
  flags.DEFINE_integer("prefix", DEFAULTS["prefix"], "Tokens prefilled before teacher-forced decoding.")
  flags.DEFINE_bool("record", False, "Measure the checkpoint (defaults) and write its metrics.json.")
  flags.DEFINE_bool("json", False, "Print JSON instead of a markdown table.")
  # Run the imported module's main, not __main__'s: mode providers register into `moe_jax.eval`'s registries.
  from moe_jax import eval as _canonical  # pylint: disable=g-import-not-at-top
  app.run(_canonical.main)
