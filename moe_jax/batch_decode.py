"""Offline batch decoding of a JSONL file through the serving engine, resumable, with a progress bar.

    python -m moe_jax.batch_decode --checkpoint=tiny-trained --input=prompts.jsonl --output=out.jsonl
    python -m moe_jax.batch_decode --config=tiny --input=prompts.jsonl --output=out.jsonl --slots=64

Input, one JSON object per line: {"id": ..., "prompt": "text"} or {"id": ..., "tokens": [ids]}, optionally
"max_tokens", "temperature", "top_k", "top_p", "stop" (list of token ids; the tokenizer's EOS always stops).
Output, one line per finished input line, in completion order:
  {"id", "line", "text", "tokens", "finish_reason"}   or   {"id", "line", "error"} for a request that failed.
Resumable: ids already present in the output are skipped, so rerunning after an interruption finishes the rest; a
torn last line (a record the interruption cut short) is first truncated away, so the output stays valid JSONL, and
its request is redone.
A bad line (invalid JSON, no id, a duplicate id, a prompt the engine rejects) is reported on stderr with its line
number (and in the output when it has an id); the other lines continue. The output holds one record per id: a later
line repeating an earlier line's id is a duplicate, reported (naming both lines) and counted bad on every run, a
resume included, and never written.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

from moe_jax.serving import Engine, EngineConfig, InvalidRequest, QueueFull
from moe_jax.serving.request import validate_request
from moe_jax.tokenizer import decode_continuation

_SAMPLING = ("temperature", "top_k", "top_p")


def read_done_ids(path: str) -> set:
  """Ids already in the output file (lines that do not parse, e.g. a torn last line, are ignored)."""
  done = set()
  if not os.path.exists(path):
    return done
  with open(path) as f:
    for line in f:
      try:
        done.add(json.loads(line)["id"])
      except (ValueError, KeyError, TypeError):
        continue
  return done


def truncate_torn_tail(path: str, block: int = 1 << 16) -> int:
  """Cuts a last line without its newline (torn by an interruption) off the file; returns the bytes removed.

  The file then ends at the end of its last complete line (or is empty), so appending keeps it valid JSONL. A torn
  line is removed even when it happens to parse: its id is then not in `read_done_ids`, and the request is redone.
  """
  if not os.path.exists(path):
    return 0
  with open(path, "r+b") as f:
    size = f.seek(0, os.SEEK_END)
    end = size
    while end > 0:  # scan back, a block at a time, for the last newline
      start = max(0, end - block)
      f.seek(start)
      i = f.read(end - start).rfind(b"\n")
      if i >= 0:
        end = start + i + 1
        break
      end = start
    if end < size:
      f.truncate(end)
    return size - end


class BadLine(ValueError):
  """A line `parse_line` refuses; `request_id` is its id when the line has a valid one (else None)."""

  def __init__(self, message: str, request_id=None):
    super().__init__(message)
    self.request_id = request_id


def parse_line(text: str, tokenizer, default_max_tokens: int) -> dict:
  """One input line -> {"id", "prompt" (token ids), "max_tokens", "sampling", "stop"}; BadLine (a ValueError, with
  the line's id when it has one) if bad."""
  try:
    obj = json.loads(text)
  except ValueError as e:
    raise ValueError(f"invalid JSON: {e}") from e
  if not isinstance(obj, dict):
    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
  if "id" not in obj or not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
    raise ValueError("missing \"id\" (a string or an int)")
  rid = obj["id"]
  if ("prompt" in obj) == ("tokens" in obj):
    raise BadLine("give exactly one of \"prompt\" (text) or \"tokens\" (ids)", rid)
  if "prompt" in obj:
    if not isinstance(obj["prompt"], str):
      raise BadLine("\"prompt\" must be a string", rid)
    try:
      prompt = tokenizer.encode(obj["prompt"])
    except UnicodeError as e:  # e.g. a lone surrogate ("\ud800"), which JSON allows and UTF-8 cannot hold
      raise BadLine(f"\"prompt\" is not encodable text: {e}", rid) from e
  else:
    prompt = obj["tokens"]
  stop = obj.get("stop", [])
  if not isinstance(stop, list):
    raise BadLine("\"stop\" must be a list of token ids", rid)
  return {"id": obj["id"], "prompt": prompt, "max_tokens": obj.get("max_tokens", default_max_tokens),
          "sampling": {k: obj[k] for k in _SAMPLING if k in obj}, "stop": stop}


def check_paths(input_path: str, output_path: str) -> None:
  """Raises ValueError naming --input or --output when the input cannot be read or the output cannot be appended to
  (the CLI checks this before building the model)."""
  if not os.path.isfile(input_path) or not os.access(input_path, os.R_OK):
    raise ValueError(f"--input={input_path!r} is not a readable file")
  if os.path.isdir(output_path):
    raise ValueError(f"--output={output_path!r} is a directory, not a JSONL file")
  if os.path.exists(output_path) and os.path.samefile(input_path, output_path):  # its results would be appended to it
    raise ValueError(f"--output={output_path!r} is the --input file: results are appended to --output")
  parent = os.path.dirname(os.path.abspath(output_path))
  if (os.path.exists(output_path) and not os.access(output_path, os.W_OK)) or not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"--output={output_path!r} cannot be written (its directory must exist and be writable)")


def run(model, tokenizer, *, input_path: str, output_path: str, engine_config: EngineConfig,
        max_tokens: int = 64, progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
  """Decodes every line of `input_path` not yet in `output_path`; returns counts.

  Returns:
    {"lines", "skipped" (already done), "bad" (rejected lines, duplicate ids included), "finished", "failed"}.
  """
  if not isinstance(max_tokens, int) or max_tokens < 1:  # the default of every line without its own: refuse it once
    raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
  log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
  with open(input_path, encoding="utf-8") as f:  # lines end at "\n" only: JSON strings may hold U+2028 and the like
    lines = f.read().split("\n")
  if lines and not lines[-1]:
    lines.pop()
  torn = truncate_torn_tail(output_path)
  if torn:
    log(f"{output_path}: removed a torn last line ({torn} bytes) left by an interrupted run; its request is redone")
  done = read_done_ids(output_path)
  engine = Engine(model, engine_config)
  eos = getattr(tokenizer, "eos_id", None)
  counts = {"lines": 0, "skipped": 0, "bad": 0, "finished": 0, "failed": 0}
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=sum(1 for line in lines if line.strip()), desc="batch_decode", unit="req")
  first_line = {}  # id -> the input line that claimed it (the first with that id)
  with open(output_path, "a") as out:
    def write(record: dict) -> None:
      out.write(json.dumps(record) + "\n")
      out.flush()  # every finished request is on disk: an interrupted run resumes after it

    def tick() -> None:
      if bar is not None:
        bar.update(1)

    def finish(h, line_no: int):
      if h.error is not None:
        counts["failed"] += 1
        log(f"{input_path}:{line_no}: id {h.request_id!r} failed: {h.error}")
        write({"id": h.request_id, "line": line_no, "error": str(h.error)})
      else:
        counts["finished"] += 1
        text = decode_continuation(tokenizer, h.request.prompt, h.tokens)
        write({"id": h.request_id, "line": line_no, "text": text, "tokens": h.tokens, "finish_reason": h.finish_reason})
      tick()

    for line_no, text in enumerate(lines, start=1):
      if not text.strip():
        continue
      counts["lines"] += 1
      try:
        req, error = parse_line(text, tokenizer, max_tokens), None
        rid = req["id"]
      except ValueError as e:
        req, error, rid = None, e, getattr(e, "request_id", None)
      if rid is not None and rid in first_line:
        # Decided from the input alone, before `done`, so a run and its resume count and report it alike; the id's
        # one output record stays its first line's.
        counts["bad"] += 1
        log(f"{input_path}:{line_no}: bad line: duplicate id {rid!r} (first on line {first_line[rid]})")
        tick()
        continue
      if rid is not None:
        first_line[rid] = line_no
      stops = None if error is not None else list(req["stop"]) + ([eos] if eos is not None else [])
      if error is None:  # the engine's own checks, before `done` too: a refused line is bad on a resume as well
        try:
          validate_request(req["prompt"], max_tokens=req["max_tokens"], sampling=req["sampling"], stop_tokens=stops,
                           vocab_size=engine.vocab_size, cache_len=engine_config.cache_len,
                           max_prompt_len=engine_config.max_prompt_len, request_id=rid)
        except InvalidRequest as e:
          error = e
      if error is not None:
        counts["bad"] += 1
        log(f"{input_path}:{line_no}: id {rid!r} rejected: {error}" if isinstance(error, InvalidRequest) else
            f"{input_path}:{line_no}: bad line: {error}")
        if rid is not None and rid not in done:  # in the output too, once
          write({"id": rid, "line": line_no, "error": str(error)})
        tick()
        continue
      if rid in done:
        counts["skipped"] += 1
        tick()
        continue
      while True:
        try:
          engine.submit(req["prompt"], max_tokens=req["max_tokens"], sampling=req["sampling"], stop_tokens=stops,
                        request_id=req["id"], on_finish=lambda h, n=line_no: finish(h, n))
          break
        except InvalidRequest as e:
          counts["bad"] += 1
          log(f"{input_path}:{line_no}: id {req['id']!r} rejected: {e}")
          write({"id": req["id"], "line": line_no, "error": str(e)})
          tick()
          break
        except QueueFull:  # let the engine drain, then retry
          engine.step()
      if engine.num_queued >= engine_config.num_slots:
        engine.step()  # keep the queue short: decode while reading
    engine.run_until_idle()
  if bar is not None:
    bar.close()
  return counts


def int_list(name: str, values) -> tuple[int, ...]:
  """A list flag's values as ints (ValueError naming --name otherwise)."""
  try:
    return tuple(int(x) for x in values)
  except ValueError:
    raise ValueError(f"--{name}={','.join(values)!r} must be a comma-separated list of ints") from None


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  from moe_jax import cli  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  check_paths(f.input, f.output)
  prefill_lengths, prefill_batches = int_list("prefill_lengths", f.prefill_lengths), int_list("prefill_batches",
                                                                                                f.prefill_batches)
  config, model, tokenizer = cli.from_flags(f)
  cache_len = f.cache_len or config.max_seq_len
  lengths = tuple(sorted({min(x, cache_len) for x in prefill_lengths}))
  engine_config = EngineConfig(num_slots=f.slots, cache_len=cache_len, kv_cache=f.kv_cache, prefill_lengths=lengths,
                               prefill_batches=prefill_batches,
                               max_queue=max(4 * f.slots, 64), seed=f.seed)
  counts = run(model, tokenizer, input_path=f.input, output_path=f.output, engine_config=engine_config,
               max_tokens=f.max_tokens, progress=not f.quiet)
  print(json.dumps(counts), file=sys.stderr)


if __name__ == "__main__":
  from absl import app, flags

  from moe_jax import cli

  flags.DEFINE_string("config", "tiny", "Preset name (random weights).")
  flags.DEFINE_string("checkpoint", None, "Shipped checkpoint name (e.g. tiny-trained) or a checkpoint directory.")
  flags.DEFINE_string("hf", None, "Hugging Face model directory.")
  flags.DEFINE_string("input", None, "JSONL prompts.", required=True)
  flags.DEFINE_string("output", None, "JSONL results (appended; ids already there are skipped).", required=True)
  flags.DEFINE_integer("max_tokens", 64, "Default max_tokens of a line without one.")
  flags.DEFINE_integer("slots", 32, "Decode slots.")
  flags.DEFINE_integer("cache_len", 0, "Positions per slot (0: the model's max_seq_len).")
  flags.DEFINE_string("kv_cache", "bf16", "KV cache mode.")
  cli.define_kv_calib_windows()
  flags.DEFINE_list("prefill_lengths", ["32", "128", "512"], "Prefill bucket lengths.")
  flags.DEFINE_list("prefill_batches", ["1", "8"], "Prefill group sizes.")
  flags.DEFINE_integer("seed", 0, "PRNG seed.")
  flags.DEFINE_bool("quiet", False, "No progress bar.")
  app.run(main)
