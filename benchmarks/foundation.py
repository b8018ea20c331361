"""Foundation numbers on the GPU: prefill ms and decode ms/token of a preset at several batch sizes, next to the
bf16 roofline (bytes of active weights + KV read per decode step ÷ copy bandwidth measured in the same run).

    PYTHONPATH=$PWD python3 benchmarks/foundation.py --config=small --out=benchmarks/results
"""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import configs
from benchmarks.timing import median_ms
from moe_jax import decode
from moe_jax.config import param_counts
from moe_jax.generate import decode_loop, last_logits
from moe_jax.sampling import SamplingParams

flags.DEFINE_string("config", "small", "Preset.")
flags.DEFINE_list("batches", ["1", "64"], "Batch sizes.")
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per sequence.")
flags.DEFINE_integer("steps", 64, "Decode steps timed.")
flags.DEFINE_integer("repeats", 5, "Timed repeats (median).")
flags.DEFINE_string("kv_cache", "bf16", "Cache mode.")
flags.DEFINE_string("out", "benchmarks/results", "Output folder.")
FLAGS = flags.FLAGS


def copy_bandwidth() -> float:
  """Bytes/s of a 1 GiB bf16 elementwise x*2 (read + write counted), the same probe as shared/GPU.md."""
  x = jnp.ones((1 << 29,), jnp.bfloat16)
  f = jax.jit(lambda a: a * 2)
  ms = median_ms(lambda: f(x), 20)
  return 2 * x.nbytes / (ms / 1e3)


def decode_step_bytes(c, batch: int, context: int, bytes_per_weight: float = 2.0) -> float:
  """Bytes a decode step must read: attention/router/shared/dense weights, the distinct experts touched (expected
  count under uniform routing), the LM head, and the KV cache of every sequence."""
  counts = param_counts(c)
  n_moe = sum(c.is_moe_layer(i) for i in range(c.n_layers))
  expected_experts = c.n_experts * (1 - (1 - c.n_experts_per_tok / c.n_experts) ** batch)
  routed_active = n_moe * c.n_experts_per_tok * counts["per_expert"]
  weights = counts["active"] - routed_active + n_moe * expected_experts * counts["per_expert"]
  kv = batch * context * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
  return weights * bytes_per_weight + kv


def main(argv):
  del argv
  c = configs.get(FLAGS.config)
  bw = copy_bandwidth()
  model = decode.init_model(c, seed=0)
  rows = []
  for b in map(int, FLAGS.batches):
    cache_len = FLAGS.prompt_len + FLAGS.steps + 1
    tokens = np.random.randint(0, c.vocab_size, (b, FLAGS.prompt_len)).astype(np.int32)
    lengths = np.full((b,), FLAGS.prompt_len, np.int32)
    prefill = lambda: decode.prefill(model, tokens, lengths, kv_cache=FLAGS.kv_cache, cache_len=cache_len)
    prefill_ms = median_ms(prefill, FLAGS.repeats)
    logits, cache = prefill()
    first = last_logits(logits, jnp.asarray(lengths))
    params = SamplingParams().arrays(b)
    loop = lambda: decode_loop(model, cache, first, jax.random.key(0), *params, max_new_tokens=FLAGS.steps,
                               eos_id=None)[0]
    decode_ms = median_ms(loop, FLAGS.repeats) / (FLAGS.steps - 1)
    need = decode_step_bytes(c, b, FLAGS.prompt_len + FLAGS.steps // 2)
    rows.append(dict(config=c.name, batch=b, prompt_len=FLAGS.prompt_len, kv_cache=FLAGS.kv_cache,
                     prefill_ms=prefill_ms, decode_ms_per_token=decode_ms, decode_bytes_per_step=need,
                     roofline_ms=need / bw * 1e3, fraction_of_roofline=need / bw * 1e3 / decode_ms))
    print(rows[-1], flush=True)
  meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, jax=jax.__version__,
              copy_bandwidth_tb_s=bw / 1e12, params_total=param_counts(c)["total"])
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, "foundation.json"), "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=2)
  lines = [f"# Foundation decode numbers ({meta['date']}, {meta['device']}, jax {meta['jax']})", "",
           f"Config `{c.name}` ({meta['params_total'] / 1e9:.2f}B params, bf16 weights, random init), "
           f"kv_cache={FLAGS.kv_cache}, prompt {FLAGS.prompt_len} tokens, {FLAGS.steps} greedy decode steps in the "
           f"on-device loop. Copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s.", "",
           "| batch | prefill ms | decode ms/token | bytes/step (weights+KV) | roofline ms | roofline / measured |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['batch']} | {r['prefill_ms']:.2f} | {r['decode_ms_per_token']:.3f} | "
                 f"{r['decode_bytes_per_step'] / 1e9:.2f} GB | {r['roofline_ms']:.3f} | "
                 f"{r['fraction_of_roofline']:.0%} |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(FLAGS.out, "foundation.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main)
