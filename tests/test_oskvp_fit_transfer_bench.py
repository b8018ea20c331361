"""benchmarks/oskvp_fit_transfer.py on one window of tiny-trained: every layer, kind and column, the report files."""

import json
import os

from benchmarks import oskvp_fit_transfer as bench


def test_one_window_writes_every_row(tmp_path):
  assert bench.main(["--windows=1", "--prefixes=128", f"--out={tmp_path}"]) == 0
  with open(os.path.join(tmp_path, "oskvp_fit_transfer_cpu.json"), encoding="utf-8") as f:
    rows = json.load(f)["rows"]
  assert [(r["layer"], r["kind"]) for r in rows] == [(l, k) for l in range(4) for k in ("keys", "values")]
  for r in rows:
    assert all(0 < r[c] < 1 for c in bench.COLUMNS), r
    # Lloyd-Max started from the prefill's levels cannot code the tokens it is refitted on worse (2%: the fp8 scales)
    assert r["later, U kept + codebooks refitted"] <= 1.02 * r["later, prefill fit"], r
  assert "| 0 | 128 | values |" in open(os.path.join(tmp_path, "oskvp_fit_transfer_cpu.md"), encoding="utf-8").read()
