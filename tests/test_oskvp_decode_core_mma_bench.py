"""benchmarks/oskvp_decode_core_mma_bench.py --smoke on the CPU: the numpy model of the warp-level core checked
against its XLA model in the report (the GPU run checks the kernel itself the same way)."""

import json
import os

from benchmarks import oskvp_decode_core_mma_bench as bench


def test_smoke_run_checks_the_model_and_writes_the_report(tmp_path):
  assert bench.main([f"--out={tmp_path}", "--smoke"]) == 0
  with open(os.path.join(tmp_path, "oskvp_decode_core_mma.json"), encoding="utf-8") as f:
    res = json.load(f)
  assert len(res["checks"]) == len(bench.SMOKE_CHECKS) and not res["rows"]
  for c in res["checks"]:
    assert c["ok"] and c["max_abs_err_vs_model"] < 1e-4
    assert c["max_abs_err_vs_exact_softmax"] < 0.1  # 127-level p on random codes (flat attention)
  assert "## Checks" in open(os.path.join(tmp_path, "oskvp_decode_core_mma.md"), encoding="utf-8").read()
