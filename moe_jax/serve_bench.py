"""Serving benchmark: a closed-loop client keeps `concurrency` requests in flight on the engine and reports TTFT,
per-token latency p50/p90/p99, throughput, slot occupancy and KV bytes in use (markdown + JSON).

    python -m moe_jax.serve_bench --config=tiny --requests=200 --concurrency=32 --prompt_len=64 --gen_len=32
    python -m moe_jax.serve_bench --checkpoint=tiny-trained ...   |   --hf=DIR ...

Prompts are random token ids of exactly `prompt_len` tokens; each request generates exactly `gen_len` tokens (no
stop token), greedy unless --temperature > 0. The engine is warmed up (every shape compiled) before the clock starts.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from moe_jax.serving import Engine, EngineConfig
from moe_jax.serving import metrics as metrics_lib


def run(model, *, requests: int, concurrency: int, prompt_len: int, gen_len: int, slots: int = 0,
        kv_cache: str = "bf16", cache_len: int = 0, prefill_batches: tuple[int, ...] = (1, 8),
        temperature: float = 0.0, seed: int = 0) -> dict:
  """Runs the closed loop and returns `metrics.summarize`'s dict plus the settings.

  Args:
    model: the Transformer.
    requests: N, requests in total.
    concurrency: C, requests in flight (a new one is submitted when one ends).
    prompt_len, gen_len: tokens per prompt / generated per request.
    slots: decode slots (0: C).
    cache_len: positions per slot (0: prompt_len + gen_len).
    prefill_batches: prefill group sizes compiled.
  """
  for name, v in (("requests", requests), ("concurrency", concurrency), ("prompt_len", prompt_len),
                  ("gen_len", gen_len)):
    if v < 1:
      raise ValueError(f"{name}={v} must be >= 1")
  cache_len = cache_len or prompt_len + gen_len
  if prompt_len + gen_len - 1 > cache_len:  # the engine would refuse every request, after compiling and warming up
    raise ValueError(f"cache_len={cache_len} is below prompt_len + gen_len - 1 = {prompt_len + gen_len - 1} (every "
                     "generated token but the last is written to the cache)")
  bucket = min(1 << (prompt_len - 1).bit_length(), cache_len)
  if not prefill_batches:
    raise ValueError("prefill_batches must name at least one prefill group size")
  batches = tuple(sorted({min(b, concurrency) for b in prefill_batches}))
  config = EngineConfig(num_slots=slots or concurrency, cache_len=cache_len, kv_cache=kv_cache,
                        prefill_lengths=(bucket,), prefill_batches=batches, max_queue=max(requests, 1),
                        max_prefill_rows=max(batches), chunked_prefill=False, seed=seed)
  engine = Engine(model, config)
  engine.warmup()
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  prompts = rng.integers(0, vocab, (requests, prompt_len)).tolist()
  sampling = {"temperature": temperature}
  handles, submitted = [], 0

  def submit_next(_=None):
    nonlocal submitted
    if submitted < requests:
      handles.append(engine.submit(prompts[submitted], max_tokens=gen_len, sampling=sampling,
                                   on_finish=submit_next))
      submitted += 1

  t0 = time.perf_counter()
  for _ in range(min(concurrency, requests)):
    submit_next()
  engine.run_until_idle()
  wall = time.perf_counter() - t0
  summary = metrics_lib.summarize(handles, engine, wall)
  summary["settings"] = dict(config=model.config.name, requests=requests, concurrency=concurrency,
                             prompt_len=prompt_len, gen_len=gen_len, slots=config.num_slots, kv_cache=kv_cache,
                             cache_len=cache_len, prefill_lengths=list(config.prefill_lengths),
                             prefill_batches=list(config.prefill_batches), temperature=temperature)
  return summary


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from moe_jax import cli  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  if f.out:  # an unusable --out fails now, not after building and benchmarking the model
    try:
      os.makedirs(f.out, exist_ok=True)
    except OSError as e:
      raise ValueError(f"--out={f.out!r} cannot be created: {e}") from e
  _, model, _ = cli.from_flags(f)
  summary = run(model, requests=f.requests, concurrency=f.concurrency, prompt_len=f.prompt_len, gen_len=f.gen_len,
                slots=f.slots, kv_cache=f.kv_cache, cache_len=f.cache_len,
                prefill_batches=tuple(int(b) for b in f.prefill_batches), temperature=f.temperature, seed=f.seed)
  summary["device"] = jax.devices()[0].device_kind
  summary["jax"] = jax.__version__
  s = summary["settings"]
  title = (f"Serving benchmark: {s['config']}, {s['requests']} requests, concurrency {s['concurrency']}, prompt "
           f"{s['prompt_len']}, gen {s['gen_len']}, kv_cache={s['kv_cache']} ({summary['device']})")
  text = metrics_lib.markdown(summary, title)
  print(text)
  if f.out:
    with open(os.path.join(f.out, "serve_bench.json"), "w") as fh:
      json.dump(metrics_lib.json_safe(summary), fh, indent=2)  # strict JSON: NaN (no decode steps) as null
    with open(os.path.join(f.out, "serve_bench.md"), "w") as fh:
      fh.write(text)


if __name__ == "__main__":
  from absl import app, flags

  from moe_jax import cli

  flags.DEFINE_string("config", "tiny", "Preset name (random weights).")
  flags.DEFINE_string("checkpoint", None, "Shipped checkpoint name or a checkpoint directory.")
  flags.DEFINE_string("hf", None, "Hugging Face model directory.")
  flags.DEFINE_integer("seed", 0, "PRNG seed (random weights, prompts, sampling).")
  flags.DEFINE_integer("requests", 64, "Requests in total.")
  flags.DEFINE_integer("concurrency", 16, "Requests in flight.")
  flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per request.")
  flags.DEFINE_integer("gen_len", 16, "Generated tokens per request.")
  flags.DEFINE_integer("slots", 0, "Decode slots (0: --concurrency).")
  flags.DEFINE_string("kv_cache", "bf16", "KV cache mode.")
  cli.define_kv_calib_windows()
  flags.DEFINE_integer("cache_len", 0, "Positions per slot (0: prompt_len + gen_len).")
  flags.DEFINE_list("prefill_batches", ["1", "8"], "Prefill group sizes compiled.")
  flags.DEFINE_float("temperature", 0.0, "0: greedy.")
  flags.DEFINE_string("out", "", "Folder for serve_bench.md / .json (empty: print only).")
  app.run(main)
