"""benchmarks/oskvp_refit_parts.py at a tiny shape on the CPU: every part timed (no Jacobi eigh there), the files;
--kernels (CUPTI) refused off the GPU."""

import json
import os

import pytest

from benchmarks import oskvp_refit_parts as bench


def test_tiny_run_writes_every_part(tmp_path):
  assert bench.main([f"--out={tmp_path}", "--batch=2", "--kv_heads=1", "--head_dim=16", "--window=8",
                     "--cache_len=32", "--repeats=1"]) == 0
  with open(os.path.join(tmp_path, "oskvp_refit_parts_cpu.json"), encoding="utf-8") as f:
    res = json.load(f)
  parts = [r["part"] for r in res["rows"]]
  assert parts[:6] == ["key + value fit, 1 row", "key + value fit, one eigh call, 1 row", "key fit, 1 row",
                       "value fit, 1 row", "key + value fit, 2 rows at once",
                       "key + value fit, one eigh call, 2 rows at once"]
  assert [p for p in parts if p.startswith("eigh")] == [f"eigh {n} x 16x16, default" for n in (1, 2, 4)]
  lloyd = [f"lloyd_max {n} heads x 64 samples, 16 iters, {i}" for n in (1, 2) for i in ("xla", "pallas")]  # K, B*K
  assert [p for p in parts if p.startswith("lloyd_max")] == lloyd
  diffs = [r["max_abs_diff_vs_xla"] for r in res["rows"] if "max_abs_diff_vs_xla" in r]
  assert len(diffs) == 2 and max(diffs) < 1e-4, diffs  # the interpreted kernel agrees with XLA's levels
  assert all(r["ms"] > 0 for r in res["rows"]) and "kernels" not in res
  assert "| key fit, 1 row |" in open(os.path.join(tmp_path, "oskvp_refit_parts_cpu.md")).read()


def test_kernels_need_a_gpu(tmp_path):
  with pytest.raises(SystemExit):
    bench.main([f"--out={tmp_path}", "--kernels"])
