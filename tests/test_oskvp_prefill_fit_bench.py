"""benchmarks/oskvp_prefill_fit.py at a tiny shape on the CPU: every case timed, the fit calls it reports, the
batched builds' caches as good as the per-layer ones, the report files; bad arguments refused."""

import json
import os

import pytest

from benchmarks import oskvp_prefill_fit as bench


def test_tiny_run_writes_every_case(tmp_path):
  """L = 3 layers, B = 1 and 2, chunks 1 and 4 (and 4 again with the XLA Lloyd form): max(1, chunk // B) layers a
  fit, at most L (B = 1: 1 and 3 layers a fit; B = 2: 1, the floor of 1 // 2 = 0 raised, and 2 layers a fit in two
  calls, the last one short), each case timed with its compiled program's temporaries, the batched builds' caches as
  good as the per-layer ones, the report files. A chunk of one layer is the per-layer build's program and the XLA
  form is the CPU's "auto": four programs compiled (the others read back from the compilation cache)."""
  assert bench.main([f"--out={tmp_path}", "--layers=3", "--batches=1,2", "--prompt=40", "--kv_heads=1",
                     "--head_dim=32", "--window=8", "--chunks=1,4", "--xla_chunks=4", "--repeats=1", "--name=pf"]) == 0
  with open(os.path.join(tmp_path, "pf_cpu.json"), encoding="utf-8") as f:
    res = json.load(f)
  got = [(r["batch"], r["case"], r["fit_calls"]) for r in res["rows"]]
  assert got == [(1, "per layer", 3), (1, "chunk 1 (1 layer a fit)", 3), (1, "chunk 4 (3 layers a fit)", 1),
                 (1, "per layer, Lloyd xla", 3), (1, "chunk 4 (3 layers a fit), Lloyd xla", 1),
                 (2, "per layer", 3), (2, "chunk 1 (1 layer a fit)", 3), (2, "chunk 4 (2 layers a fit)", 2),
                 (2, "per layer, Lloyd xla", 3), (2, "chunk 4 (2 layers a fit), Lloyd xla", 2)]
  assert all(r["ms"] > 0 and r["temp_bytes"] > 0 for r in res["rows"])
  # each Lloyd form against its own per-layer build
  assert [r["speedup"] is None for r in res["rows"]] == [True, False, False, True, False] * 2
  for b in (1, 2):  # the same fits (the CPU's "auto" is the XLA form): the same reconstruction error
    errs = [r["rel_err"] for r in res["rows"] if r["batch"] == b]
    assert 0 < errs[0] < 0.2 and max(errs) - min(errs) < 1e-6 * errs[0], errs
  assert res["shape"]["cache_len"] == 48
  assert "| 2 | chunk 4 (2 layers a fit) | 2 |" in open(os.path.join(tmp_path, "pf_cpu.md")).read()


def test_bad_arguments_are_refused(tmp_path):
  with pytest.raises(SystemExit):
    bench.main([f"--out={tmp_path}", "--chunks=0"])


def test_compile_only_reports_compiles_and_temporaries(tmp_path):
  assert bench.main([f"--out={tmp_path}", "--compile_only", "--layers=3", "--batches=1", "--prompt=40",
                     "--kv_heads=1", "--head_dim=32", "--window=8", "--chunks=8", "--name=cc"]) == 0
  with open(os.path.join(tmp_path, "cc_cpu.json"), encoding="utf-8") as f:
    res = json.load(f)
  assert [(r["case"], r["fit_calls"]) for r in res["rows"]] == [("per layer", 3), ("chunk 8 (3 layers a fit)", 1)]
  assert all(r["compile_s"] > 0 and r["temp_bytes"] > 0 and "ms" not in r for r in res["rows"])
  assert "| 1 | chunk 8 (3 layers a fit) | 1 |" in open(os.path.join(tmp_path, "cc_cpu.md")).read()
