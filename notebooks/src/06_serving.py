# %% [markdown]
# # Serving: continuous batching over decode slots
# The engine holds a fixed number of slots over one KV cache. Requests wait in a bounded queue; each scheduler step
# admits queued requests into free slots (bucketed prefill, first token sampled, rows inserted into the slot cache
# with one `tree_map`), then runs ONE compiled decode step over all slots, inactive ones masked. Tokens stream back
# per request. Everything here imports the package; this runs the shipped tiny-trained model on CPU.

# %%
import json
import tempfile

from moe_jax import batch_decode, checkpoints, serve_bench
from moe_jax.serving import Engine, EngineConfig, InvalidRequest, QueueFull, steps
from moe_jax.serving import metrics
from moe_jax.tokenizer import ByteTokenizer

config, model = checkpoints.load("tiny-trained")
tok = ByteTokenizer()
engine_config = EngineConfig(num_slots=8, cache_len=64, kv_cache="bf16", prefill_lengths=(32,),
                             prefill_batches=(1, 4), max_queue=16, chunked_prefill=False)
engine = Engine(model, engine_config)
print("traces (compiles) during warm-up:", engine.warmup())

# %% [markdown]
# Submit requests with their own sampling parameters and stop tokens. One streams through an iterator (which steps
# the caller-driven engine), one through an `on_token` callback, and the third is read from its handle at the end;
# all share every decode step.

# %%
streamed = []
handles = {
    "greedy": engine.submit(tok.encode("def fibonacci(n):"), max_tokens=32, stop_tokens=[tok.eos_id]),
    "sampled": engine.submit(tok.encode("import numpy as np\n"), max_tokens=32,
                             sampling={"temperature": 0.8, "top_k": 20}, stop_tokens=[tok.eos_id]),
    "short": engine.submit(tok.encode("class Stack:"), max_tokens=8, on_token=streamed.append),
}
before = steps.total_traces()
for t in handles["greedy"]:
  pass  # tokens arrive one by one here
engine.run_until_idle()
for name, h in handles.items():
  print(f"{name:8s} {h.status:9s} {h.finish_reason:7s} {tok.decode(h.tokens)!r}")
print("streamed by callback:", streamed == handles["short"].tokens)
print("new compiles after warm-up:", steps.total_traces() - before)

# %% [markdown]
# Bad input is rejected at `submit` with a clear error for that request only; a full queue raises `QueueFull`
# (back-pressure) instead of crashing; a request can be cancelled, queued (as here) or running, and ends at the
# engine's next step.

# %%
for bad in ([], [1, 2, 999], [1] * 80):
  try:
    engine.submit(bad, max_tokens=4)
  except InvalidRequest as e:
    print("rejected:", e)
try:
  engine.submit([1, 2], max_tokens=4, sampling={"top_p": 1.5})
except InvalidRequest as e:
  print("rejected:", e)
queued = [engine.submit(tok.encode("x = "), max_tokens=4) for _ in range(engine_config.max_queue)]
try:
  engine.submit(tok.encode("one too many"), max_tokens=4)
except QueueFull as e:
  print("back-pressure:", e)
queued[0].cancel()
engine.run_until_idle()
print("statuses:", sorted({h.status for h in queued}), "cancelled:", queued[0].status)

# %% [markdown]
# `serve_bench`: a closed-loop client keeps `concurrency` requests in flight and reports TTFT, per-token latency,
# throughput, slot occupancy and KV bytes in use (`python -m moe_jax.serve_bench ...` prints the same table).

# %%
summary = serve_bench.run(model, requests=32, concurrency=8, prompt_len=32, gen_len=16, kv_cache="bf16",
                          cache_len=64, prefill_batches=(1, 4))
print(metrics.markdown(summary, "tiny-trained on CPU"))

# %% [markdown]
# `batch_decode`: a JSONL file through the engine; bad lines are reported with their line number and the rest
# continue; rerunning skips ids already in the output (`python -m moe_jax.batch_decode --input=... --output=...`).

# %%
work = tempfile.mkdtemp()
lines = [json.dumps({"id": 1, "prompt": "def add(a, b):", "max_tokens": 24}), "{not json",
         json.dumps({"id": 2, "prompt": "for i in range(", "max_tokens": 16})]
with open(f"{work}/in.jsonl", "w") as f:
  f.write("\n".join(lines) + "\n")
for attempt in range(2):
  counts = batch_decode.run(model, tok, input_path=f"{work}/in.jsonl", output_path=f"{work}/out.jsonl",
                            engine_config=engine_config, max_tokens=16, progress=False)
  print(f"run {attempt + 1}:", counts)
print(open(f"{work}/out.jsonl").read())
