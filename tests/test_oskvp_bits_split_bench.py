"""benchmarks/oskvp_bits_split.py on one window of tiny-trained, two pairs: the rows and the report files."""

import json
import os

from benchmarks import oskvp_bits_split as bench


def test_one_window_two_pairs(tmp_path):
  assert bench.main(["--windows=1", "--pairs=exact/exact;2-bit/2-bit, block codebooks", f"--out={tmp_path}"]) == 0
  with open(os.path.join(tmp_path, "oskvp_bits_split_cpu.json"), encoding="utf-8") as f:
    rows = json.load(f)["rows"]
  assert [(r["keys"], r["values"]) for r in rows] == [("exact", "exact"), ("2-bit", "2-bit, block codebooks")]
  assert rows[0]["bpb"] == rows[0]["exact_bpb"]  # the same pass: nothing compressed
  assert rows[1]["bpb"] != rows[1]["exact_bpb"] and abs(rows[1]["rel"]) < 0.2  # compressed: close, not equal
  assert "| 2-bit | 2-bit, block codebooks |" in open(os.path.join(tmp_path, "oskvp_bits_split_cpu.md"),
                                                       encoding="utf-8").read()
