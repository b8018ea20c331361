"""benchmarks/oskvp_refit_cost.py at a tiny shape on the CPU: the timed cases for two chunk sizes, the report files;
a step over several layers, refitting across layers and per layer; --rows checked."""

import json
import os

import pytest

from benchmarks import oskvp_refit_cost as bench


def test_tiny_run_writes_every_case(tmp_path):
  assert bench.main([f"--out={tmp_path}", "--batch=2", "--kv_heads=1", "--group=2", "--head_dim=32", "--window=8",
                     "--cache_len=32", "--repeats=1", "--refit_chunks=1,2", "--name=refit"]) == 0
  with open(os.path.join(tmp_path, "refit_cpu.json"), encoding="utf-8") as f:
    res = json.load(f)
  assert [r["case"] for r in res["rows"]] == [
      "no flush", "all rows flush, prefill fit", "all rows flush, refit off", "1 row flushes with a refit, chunk 1",
      "all 2 rows flush with a refit, chunk 1", "1 row flushes with a refit, chunk 2",
      "all 2 rows flush with a refit, chunk 2"]
  assert [r["rows_refitted"] for r in res["rows"]] == [0, 0, 0, 1, 2, 1, 2]
  assert all(r["ms"] > 0 for r in res["rows"]) and res["shape"]["window"] == 8
  assert "| 1 row flushes with a refit, chunk 2 | 1 |" in open(os.path.join(tmp_path, "refit_cpu.md")).read()


def test_several_layers_across_and_per_layer(tmp_path):
  """L = 2 layers, B = 5, --rows=2 (neither 1 nor B): "no flush", then 2 rows refitted across layers and per layer,
  labelled with the rows a fit across layers, max(1, refit_chunk // L) = 4 (not min(B, refit_chunk) = 5), and the
  layers in the shape; --rows beyond --batch refused. refit_chunk 8 is the mode's default, so the across-layers step
  is the "no flush" step's program (compiled once: the persistent compilation cache)."""
  assert bench.main([f"--out={tmp_path}", "--batch=5", "--kv_heads=1", "--group=2", "--head_dim=32", "--window=8",
                     "--cache_len=32", "--repeats=1", "--refit_chunks=8", "--layers=2", "--across=1,0", "--rows=2",
                     "--only=refit", "--name=layers"]) == 0
  with open(os.path.join(tmp_path, "layers_cpu.json"), encoding="utf-8") as f:
    res = json.load(f)
  assert [(r["case"], r["rows_refitted"]) for r in res["rows"]] == [
      ("no flush", 0), ("2 rows flush with a refit, chunk 8, across layers (4 rows a fit)", 2),
      ("2 rows flush with a refit, chunk 8, per layer", 2)]
  assert res["shape"]["layers"] == 2
  with pytest.raises(SystemExit):
    bench.main([f"--out={tmp_path}", "--batch=3", "--rows=4"])
