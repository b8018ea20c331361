"""The epilogue benchmark's CPU smoke path: every form checked against the reference in interpret mode, the report
written."""

import json
import os

from benchmarks import oskvp_epilogue_bench as bench
from benchmarks import report_files


def test_smoke_checks_every_form_and_writes_the_report(tmp_path):
  assert bench.main(["--smoke", f"--out={tmp_path}"]) == 0
  with open(os.path.join(tmp_path, f"oskvp_epilogue_{report_files.device_slug()}.json")) as fh:
    res = json.load(fh)
  assert {r["form"] for r in res["rows"]} == set(bench.forms(True))
  assert all(r["rel_err"] < 1e-2 and r["us"] > 0 for r in res["rows"])
