"""The key/value benchmark's CPU paths: --smoke (interpret-mode checks + the report) and lowering every timed config."""

import json
import os

from benchmarks import oskvp_key_scores_mgpu_bench as bench


def test_smoke_checks_and_writes_the_report(tmp_path):
  assert bench.main(["--smoke", f"--out={tmp_path}"]) == 0
  with open(os.path.join(tmp_path, "oskvp_key_scores_mgpu.json")) as fh:
    res = json.load(fh)
  assert res["checks"] and all(c["ok"] for c in res["checks"])
  assert {c["a_operand"] for c in res["checks"]} == {"registers", "smem"}
  assert res["rows"] and all("cycles_per_token_head" in r for r in res["rows"])
  assert res["jax"] and res["date"] and res["device"]
  assert res["value_checks"] and all(c["ok"] for c in res["value_checks"])
  assert {c["a_operand"] for c in res["value_checks"]} == {"registers", "smem"}
  assert res["value_rows"] and all("main_cycles_per_token_head" in r for r in res["value_rows"])
  md = open(os.path.join(tmp_path, "oskvp_key_scores_mgpu.md")).read()
  assert "cycles/token-head" in md and "MISMATCH" not in md and "## Value side" in md


def test_every_timed_config_lowers_for_cuda():
  assert set(bench.SCHEDULE) == set(bench.CONFIGS) | set(bench.VALUE_CONFIGS) | set(bench.UNIFORM_CONFIGS)
  assert set(bench.DUMP_CONFIGS) <= set(bench.SCHEDULE)
  for cfg in bench.SCHEDULE:
    bench.lower_for_cuda(cfg)


def test_cycles_formula():
  # 0.108 ms over 64 × 65536 token-heads at 132 SMs × 1.98 GHz is the 6.7-cycle budget.
  assert abs(108.0 * 1980.0 * 132 / (64 * 65536) - bench.TARGET_CYCLES) < 0.05
