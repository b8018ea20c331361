"""benchmarks/sampling_cost.py at a tiny vocabulary on the CPU: every case at every batch, the report files."""

import json
import os

from benchmarks import sampling_cost as bench


def test_tiny_run_writes_every_case(tmp_path):
  assert bench.main([f"--out={tmp_path}", "--vocab=64", "--batches=1,3", "--repeats=1"]) == 0
  with open(os.path.join(tmp_path, "sampling_cost_cpu.json"), encoding="utf-8") as f:
    res = json.load(f)
  names = list(bench.cases(1))
  assert [(r["batch"], r["case"]) for r in res["rows"]] == [(b, n) for b in (1, 3) for n in names]
  assert all(r["ms"] > 0 for r in res["rows"]) and res["vocab"] == 64
  assert "| sample, top-p 0.9 |" in open(os.path.join(tmp_path, "sampling_cost_cpu.md"), encoding="utf-8").read()
