"""batch_decode (resumable, bad lines reported with their line numbers) and serve_bench (metrics) on the tiny model.

Both use engines of the same shapes (4 slots, cache_len 32, one 16-token bucket, groups of 1 and 4), so the module's
tests compile once.
"""

import json

import numpy as np
import pytest

from moe_jax import batch_decode, serve_bench
from moe_jax.serving import EngineConfig, Engine
from moe_jax.tokenizer import ByteTokenizer

ENGINE = EngineConfig(num_slots=4, cache_len=32, kv_cache="fp32", prefill_lengths=(16,), prefill_batches=(1, 4),
                      max_queue=8, chunked_prefill=False)


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")


def _good(i):
  return json.dumps({"id": f"r{i}", "prompt": f"print({i})", "max_tokens": 3 + i % 4})


def _greedy_alone(model, text, max_tokens):
  """The same request alone through a one-slot-busy engine of the same shapes."""
  eng = Engine(model, ENGINE)
  return eng.submit(ByteTokenizer().encode(text), max_tokens=max_tokens,
                    stop_tokens=[ByteTokenizer.eos_id]).result()


def test_batch_decode_bad_lines_and_resume(tmp_path, tiny_model):
  good = [_good(i) for i in range(10)]
  bad = {3: "not json", 5: json.dumps({"prompt": "no id"}), 7: json.dumps({"id": "x", "tokens": [1, 999]}),
         9: json.dumps({"id": "y", "prompt": "a", "top_p": 2.0}), 11: json.dumps({"id": "r0", "prompt": "dup"}),
         13: json.dumps({"id": "z", "prompt": "p" * 40}), 15: json.dumps({"id": "w", "prompt": 5})}
  lines, g = [], iter(good)
  for n in range(1, len(good) + len(bad) + 1):
    lines.append(bad[n] if n in bad else next(g))
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  logs = []
  # "Interrupted" run: only the first 6 input lines.
  _write(src, lines[:6])
  first = batch_decode.run(tiny_model, ByteTokenizer(), input_path=str(src), output_path=str(out),
                           engine_config=ENGINE, max_tokens=8, progress=False, log=logs.append)
  assert first == {"lines": 6, "skipped": 0, "bad": 2, "finished": 4, "failed": 0}
  with open(out, "a") as f:
    f.write('{"id": "torn')  # a line cut by the interruption is truncated away on resume
  _write(src, lines)
  logs.clear()
  second = batch_decode.run(tiny_model, ByteTokenizer(), input_path=str(src), output_path=str(out),
                            engine_config=ENGINE, max_tokens=8, progress=False, log=logs.append)
  assert second["skipped"] == 4 and second["finished"] == 6 and second["failed"] == 0
  assert second["bad"] == len(bad)  # the duplicate "r0" (line 11) too, though "r0" was done by the first run
  for n in (3, 5, 7, 9, 11, 13):
    assert any(msg.startswith(f"{src}:{n}: ") for msg in logs), (n, logs)
  assert any(msg.startswith(f"{out}: removed a torn last line") for msg in logs), logs
  records = [json.loads(x) for x in out.read_text().splitlines()]  # valid JSONL: the torn line is gone
  ids = [r["id"] for r in records]
  assert sorted(i for i in ids if i.startswith("r")) == sorted(f"r{i}" for i in range(10))  # each exactly once
  by_id = {r["id"]: r for r in records}
  assert "outside the vocabulary" in by_id["x"]["error"] and "top_p" in by_id["y"]["error"]
  assert "prompt too long" in by_id["z"]["error"]
  assert "\"prompt\" must be a string" in by_id["w"]["error"]  # a line refused while parsing, with an id (was missing)
  for i in (0, 7):
    r = by_id[f"r{i}"]
    assert r["tokens"] == _greedy_alone(tiny_model, f"print({i})", 3 + i % 4)
    assert r["text"] == ByteTokenizer().decode(r["tokens"])
    assert lines[r["line"] - 1] == good[i]


def test_batch_decode_counts_and_reports_a_duplicate_id_alike_on_a_run_and_its_resume(tmp_path, tiny_model):
  """A later line repeating an id is bad on every run, whether or not its first line was done by an earlier run (the
  resume used to count it "skipped", silently); the output keeps one record per id, the first line's."""
  lines = [json.dumps({"id": "a", "prompt": "x", "max_tokens": 2}), json.dumps({"id": "b", "prompt": "y"}),
           json.dumps({"id": "a", "prompt": "dup"}), json.dumps({"id": "c", "prompt": 5}),
           json.dumps({"id": "c", "prompt": "dup of a bad line"}), json.dumps({"id": 7, "tokens": [1, 2]}),
           json.dumps({"id": 7, "tokens": "dup of a done line, itself bad"})]
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  _write(src, lines)
  kwargs = dict(input_path=str(src), output_path=str(out), engine_config=ENGINE, max_tokens=3, progress=False)
  runs = []
  for _ in range(2):  # the run, then its resume with nothing left to do
    logs = []
    counts = batch_decode.run(tiny_model, ByteTokenizer(), log=logs.append, **kwargs)
    runs.append((counts, [m for m in logs if "duplicate" in m], out.read_text()))
  (first, first_dups, first_out), (second, second_dups, second_out) = runs
  assert first == {"lines": 7, "skipped": 0, "bad": 4, "finished": 3, "failed": 0}
  assert second == {"lines": 7, "skipped": 3, "bad": 4, "finished": 0, "failed": 0}
  assert first_dups == second_dups == [f"{src}:3: bad line: duplicate id 'a' (first on line 1)",
                                       f"{src}:5: bad line: duplicate id 'c' (first on line 4)",
                                       f"{src}:7: bad line: duplicate id 7 (first on line 6)"]
  assert second_out == first_out  # the resume writes nothing
  records = [json.loads(x) for x in first_out.splitlines()]
  assert sorted((str(r["id"]), r["line"], "error" in r) for r in records) == [
      ("7", 6, False), ("a", 1, False), ("b", 2, False), ("c", 4, True)]


def test_batch_decode_counts_a_line_the_engine_refuses_as_bad_on_a_resume_too(tmp_path, tiny_model):
  """Before: refused by the engine, a line was "bad" on the first run and "skipped" (unreported) on the resume, as its
  error record made its id "done"; a line refused while parsing stayed "bad". Both are bad on every run now."""
  lines = [json.dumps({"id": "a", "prompt": "x", "max_tokens": 2}), json.dumps({"id": "b", "prompt": 5}),
           json.dumps({"id": "c", "tokens": [1, 999]}), json.dumps({"id": "d", "prompt": "p" * 40})]
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  _write(src, lines)
  kwargs = dict(input_path=str(src), output_path=str(out), engine_config=ENGINE, max_tokens=3, progress=False)
  runs = []
  for _ in range(2):
    logs = []
    runs.append((batch_decode.run(tiny_model, ByteTokenizer(), log=logs.append, **kwargs), logs, out.read_text()))
  (first, first_logs, first_out), (second, second_logs, second_out) = runs
  assert first == {"lines": 4, "skipped": 0, "bad": 3, "finished": 1, "failed": 0}
  assert second == {"lines": 4, "skipped": 1, "bad": 3, "finished": 0, "failed": 0}
  assert first_logs == second_logs and len(first_logs) == 3
  assert first_logs[1].startswith(f"{src}:3: id 'c' rejected: token id 999")
  assert second_out == first_out and len(first_out.splitlines()) == 4  # one record per id, none added


def test_batch_decode_keeps_json_lines_whose_strings_hold_unicode_line_separators(tmp_path, tiny_model):
  prompts = {"a": "plain", "b": "x\u2028y", "c": "p\u0085q\u2029", "d": "last"}
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text("".join(json.dumps({"id": k, "prompt": v, "max_tokens": 2}, ensure_ascii=False) + "\n"
                         for k, v in prompts.items()), encoding="utf-8")
  counts = batch_decode.run(tiny_model, ByteTokenizer(), input_path=str(src), output_path=str(out),
                            engine_config=ENGINE, max_tokens=8, progress=False, log=lambda msg: None)
  assert counts == {"lines": 4, "skipped": 0, "bad": 0, "finished": 4, "failed": 0}  # before: 4 "invalid JSON"
  records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert {k: r["line"] for k, r in records.items()} == {"a": 1, "b": 2, "c": 3, "d": 4}
  assert records["b"]["tokens"] == _greedy_alone(tiny_model, prompts["b"], 2)


def test_batch_decode_refuses_a_bad_default_max_tokens_before_writing(tmp_path, tiny_model):
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  _write(src, [_good(0)])
  with pytest.raises(ValueError, match="max_tokens=0 must be an int >= 1"):
    batch_decode.run(tiny_model, ByteTokenizer(), input_path=str(src), output_path=str(out), engine_config=ENGINE,
                     max_tokens=0, progress=False)
  assert not out.exists()  # no line marked bad: a re-run with a good default decodes it


@pytest.mark.parametrize("cut", ["half", "whole"])
def test_batch_decode_resume_truncates_a_torn_last_line_and_redoes_it(tmp_path, tiny_model, cut):
  """An interrupted run's last record cut short (half of it, or all of it but its newline) is removed from the file
  and decoded again: the result is valid JSONL with every input id exactly once and the earlier records untouched."""
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  _write(src, [_good(i) for i in range(6)])
  kwargs = dict(input_path=str(src), output_path=str(out), engine_config=ENGINE, max_tokens=8, progress=False)
  assert batch_decode.run(tiny_model, ByteTokenizer(), **kwargs)["finished"] == 6
  full = out.read_text().splitlines()
  by_id = {json.loads(x)["id"]: json.loads(x) for x in full}
  torn = full[3][:len(full[3]) // 2] if cut == "half" else full[3]
  kept = "".join(x + "\n" for x in full[:3])
  out.write_text(kept + torn)  # no newline after the torn record
  logs = []
  counts = batch_decode.run(tiny_model, ByteTokenizer(), log=logs.append, **kwargs)
  assert counts == {"lines": 6, "skipped": 3, "bad": 0, "finished": 3, "failed": 0}
  assert logs == [f"{out}: removed a torn last line ({len(torn.encode())} bytes) left by an interrupted run; "
                  "its request is redone"]
  text = out.read_text()
  assert text.startswith(kept) and text.endswith("\n")
  records = [json.loads(x) for x in text.splitlines()]  # every line parses
  assert sorted(r["id"] for r in records) == sorted(f"r{i}" for i in range(6))  # each input id exactly once
  redone = json.loads(full[3])["id"]
  assert [r for r in records[3:] if r["id"] == redone] == [by_id[redone]]  # the torn record, redone in full


def test_truncate_torn_tail(tmp_path):
  p = tmp_path / "o.jsonl"
  for content, removed in [(b"a\nbb\nccc", 3), (b"a\nbb\n", 0), (b"torn", 4), (b"", 0), (b"x\n" + b"y" * 9, 9)]:
    p.write_bytes(content)
    assert batch_decode.truncate_torn_tail(str(p), block=2) == removed, content  # scans back across blocks
    assert p.read_bytes() == content[:len(content) - removed]
  assert batch_decode.truncate_torn_tail(str(tmp_path / "missing.jsonl")) == 0


def test_read_done_ids_ignores_torn_lines(tmp_path):
  p = tmp_path / "o.jsonl"
  p.write_text('{"id": 1, "text": "a"}\n{"id": "b"}\n{"id": "c", "te')
  assert batch_decode.read_done_ids(str(p)) == {1, "b"}
  assert batch_decode.read_done_ids(str(tmp_path / "missing.jsonl")) == set()


def test_serve_bench_metrics(tiny_model):
  s = serve_bench.run(tiny_model, requests=12, concurrency=4, prompt_len=16, gen_len=4, kv_cache="fp32",
                      cache_len=32, prefill_batches=(1, 4))
  assert s["statuses"] == {"finished": 12} and s["generated_tokens"] == 48
  for key in ("ttft_ms", "per_token_latency_ms", "decode_step_ms"):
    d = s[key]
    assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
  assert 0 < s["slot_occupancy_mean"] <= s["slot_occupancy_peak"] == 1.0
  per_position = s["kv_bytes_allocated"] / (4 * 32)
  # At most 4 active slots × (16 prompt + 3 fed-back tokens) positions are ever in use.
  assert 16 * per_position <= s["kv_bytes_in_use_peak"] <= 4 * 19 * per_position
  assert s["throughput_tokens_per_s"] > 0
  text = serve_bench.metrics_lib.markdown(s)
  assert "TTFT p50 / p90 / p99" in text and "slot occupancy" in text


def test_serve_bench_json_writes_null_for_non_finite_metrics():
  """gen_len 1 runs no decode step: NaN percentiles, which serve_bench --out now writes as null (bare NaN before,
  which strict parsers reject)."""
  import json  # pylint: disable=g-import-not-at-top
  summary = {"decode_step_ms": {"p50": float("nan"), "p90": np.float32("nan")}, "n": [1.5, float("inf")], "k": 3}
  text = json.dumps(serve_bench.metrics_lib.json_safe(summary), allow_nan=False)
  assert json.loads(text) == {"decode_step_ms": {"p50": None, "p90": None}, "n": [1.5, None], "k": 3}


@pytest.mark.parametrize("kwargs, message", [(dict(requests=0), "requests=0"), (dict(gen_len=0), "gen_len=0"),
                                             (dict(prefill_batches=()), "prefill_batches must name"),
                                             (dict(cache_len=8), r"cache_len=8 is below prompt_len \+ gen_len - 1 = 9")])
def test_serve_bench_rejects_bad_settings(tiny_model, kwargs, message):
  args = dict(requests=4, concurrency=2, prompt_len=8, gen_len=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    serve_bench.run(tiny_model, **args)


def test_percentiles():
  from moe_jax.serving import metrics  # pylint: disable=g-import-not-at-top
  p = metrics.percentiles(np.arange(101))
  assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (50, 90, 99, 50)
  assert np.isnan(metrics.percentiles([])["p50"])


def test_batch_decode_checks_its_paths_first(tmp_path):
  """The CLI calls `check_paths` before building the model; before, a bad --input or --output failed only after it."""
  src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  src.write_text('{"id": 1, "tokens": [1]}\n')
  batch_decode.check_paths(str(src), str(out))  # a new output file in a writable directory
  with pytest.raises(ValueError, match=r"--input='.*nope.jsonl' is not a readable file"):
    batch_decode.check_paths(str(tmp_path / "nope.jsonl"), str(out))
  with pytest.raises(ValueError, match="is a directory"):
    batch_decode.check_paths(str(src), str(tmp_path))
  with pytest.raises(ValueError, match=r"--output='.*missing/out.jsonl' cannot be written"):
    batch_decode.check_paths(str(src), str(tmp_path / "missing" / "out.jsonl"))
  # The input as the output: its last line (no newline) was cut as a torn record, the others skipped as done, and
  # the results appended to it. Refused, by either path to the file.
  (tmp_path / "link.jsonl").symlink_to(src)
  for same in (src, tmp_path / "link.jsonl", tmp_path / "." / "in.jsonl"):
    with pytest.raises(ValueError, match="is the --input file"):
      batch_decode.check_paths(str(src), str(same))
  assert src.read_text() == '{"id": 1, "tokens": [1]}\n'


def test_batch_decode_names_a_list_flag_that_is_not_ints():
  assert batch_decode.int_list("prefill_lengths", ["32", "128"]) == (32, 128)
  with pytest.raises(ValueError, match="--prefill_lengths='32,abc' must be a comma-separated list of ints"):
    batch_decode.int_list("prefill_lengths", ["32", "abc"])


def test_serve_bench_names_an_unusable_out_before_building_the_model(tmp_path):
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
  (tmp_path / "file").write_text("")
  r = subprocess.run([sys.executable, "-m", "moe_jax.serve_bench", "--config=tiny", f"--out={tmp_path}/file/sub"],
                     cwd=root, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert "ValueError: --out=" in r.stderr and "cannot be created" in r.stderr, r.stderr[-2000:]
  assert "Serving benchmark" not in r.stdout  # nothing ran


def test_batch_decode_names_a_prompt_utf8_cannot_hold():
  """JSON allows a lone surrogate; encoding it raised a bare UnicodeEncodeError, so the line's id got no record."""
  with pytest.raises(batch_decode.BadLine, match="\"prompt\" is not encodable text") as info:
    batch_decode.parse_line('{"id": "a", "prompt": "x\\ud800y"}', ByteTokenizer(), 4)
  assert info.value.request_id == "a"
