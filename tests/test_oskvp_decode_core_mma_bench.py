"""benchmarks/oskvp_decode_core_mma_bench.py --smoke on the CPU: the numpy model of the warp-level core checked
against its XLA model in the report (the GPU run checks the kernel itself the same way)."""

import json
import os

import pytest

from benchmarks import oskvp_decode_core_mma_bench as bench


def test_smoke_run_checks_the_model_and_writes_the_report(tmp_path):
  assert bench.main([f"--out={tmp_path}", "--smoke"]) == 0
  with open(os.path.join(tmp_path, "oskvp_decode_core_mma.json"), encoding="utf-8") as f:
    res = json.load(f)
  assert len(res["checks"]) == 2 * len(bench.SMOKE_CHECKS) and not res["rows"]  # both key orientations
  assert {c["key_rows"] for c in res["checks"]} == {"heads", "tokens"}
  for c in res["checks"]:
    assert c["ok"] and max(c["rel_err_vs_model"]) < 1e-4
    assert max(c["rel_err_vs_exact_softmax"]) < 0.1  # 127-level p on random codes (flat attention)


def test_timed_rows_are_validated(tmp_path):
  with pytest.raises(SystemExit):
    bench.main([f"--out={tmp_path}", "--smoke", "--timed=65536:mgpu:wired+tokens"])  # key rows: the mma core's
  with pytest.raises(SystemExit):
    bench.main([f"--out={tmp_path}", "--smoke", "--timed=65536:mma:wird"])
  assert bench.parse_variant("mma", "l2_resident+heads") == ("l2_resident", "heads")
  assert bench.parse_variant("mgpu", "codes") == ("codes", bench.dm.KEY_ROW_DEFAULT)
  assert "## Checks" in open(os.path.join(tmp_path, "oskvp_decode_core_mma.md"), encoding="utf-8").read()
