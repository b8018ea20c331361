"""Merging expert-matmul result files of runs over disjoint shapes (`benchmarks/expert_matmul.merge_runs`)."""

import json

import pytest

from benchmarks import expert_matmul as em


def _run(path, date, copy_tb_s, e, n, peer_ms, ws_ms):
  """One run's result file: one shape, one row count, the XLA peer and the WS int4 kernel; returns its path."""
  rows = []
  for impl, ms in (("xla_ragged_dot_bf16", peer_ms), ("pallas_int4_mgpu_ws", ws_ms)):
    b = 1e9  # 1 GB: tb_per_s = 1 / ms
    rows.append({"impl": impl, "rows": 16, "experts": e, "k": 4096, "n": n, "ms": ms, "bytes_read": b,
                 "tb_per_s": b / ms / 1e9})
  res = {"device": "NVIDIA H200", "jax": "0.11.2", "timing": "cupti", "date": date, "group_size": 128,
         "routing": "balanced", "correctness": {"int4_mgpu_ws_": {"max_rel_err": 1e-7, "nan": 0}},
         "copy": {"f32_sum_read_only": {"TB_per_s": copy_tb_s}, "f32_add": {"TB_per_s": copy_tb_s - 0.3}}, "rows": rows}
  path.write_text(json.dumps(res))
  return str(path)


def test_each_row_keeps_its_own_runs_copy_bandwidth(tmp_path):
  a = _run(tmp_path / "a.json", "2026-12-02T04:34", 4.0, 8, 14336, 0.2, 0.1)  # 10 TB/s: 250% of 4.0
  b = _run(tmp_path / "b.json", "2026-12-02T04:47", 5.0, 128, 768, 0.3, 0.1)  # 10 TB/s: 200% of 5.0
  merged = em.merge_runs([a, b])
  assert [r["run"] for r in merged["rows"]] == [0, 0, 1, 1]
  assert [run["experts"] for run in merged["runs"]] == [[8], [128]]
  assert merged["runs"][1]["copy"]["f32_sum_read_only"]["TB_per_s"] == 5.0
  md = em.markdown(merged)
  assert "2026-12-02T04:34 (E = 8): read-only sum 4.00 TB/s" in md and "(E = 128): read-only sum 5.00 TB/s" in md
  line = lambda e: next(x for x in md.splitlines() if x.startswith(f"| {e}, "))
  assert "[2.00x, 250%]" in line(8)  # peer 0.2 / 0.1, 10 TB/s over run 0's 4.0
  assert "[3.00x, 200%]" in line(128)  # peer 0.3 / 0.1, 10 TB/s over run 1's 5.0


def test_a_single_run_renders_as_before(tmp_path):
  with open(_run(tmp_path / "a.json", "2026-12-02T04:34", 4.0, 8, 14336, 0.2, 0.1)) as fh:
    md = em.markdown(json.load(fh))
  assert "Run and the copy bandwidth" in md and "[2.00x, 250%]" in md


def test_runs_that_time_the_same_shape_are_refused(tmp_path):
  a = _run(tmp_path / "a.json", "2026-12-02T04:34", 4.0, 8, 14336, 0.2, 0.1)
  b = _run(tmp_path / "b.json", "2026-12-02T04:47", 5.0, 8, 14336, 0.3, 0.1)
  with pytest.raises(ValueError, match="shape"):
    em.merge_runs([a, b])


def test_merge_creates_the_out_folder(tmp_path):
  a = _run(tmp_path / "a.json", "2026-12-02T04:34", 4.0, 8, 14336, 0.2, 0.1)
  b = _run(tmp_path / "b.json", "2026-12-02T04:47", 5.0, 128, 768, 0.3, 0.1)
  out = tmp_path / "new" / "dir"  # before: FileNotFoundError after the merge
  assert em.main([f"--merge={a},{b}", f"--out={out}"]) == 0
  assert (out / "expert_matmul.json").exists() and (out / "expert_matmul.md").exists()


def test_an_unknown_format_is_named(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:  # before: the run checked nothing, timed the peers and exited 0
    em.main(["--formats=int4_mgpu_wss", f"--out={tmp_path}"])
  assert exit_info.value.code == 2 and "['int4_mgpu_wss'] not among" in capsys.readouterr().err


def test_smoke_without_out_writes_to_a_temporary_folder():
  assert em.out_dir(None, False, "x") == "benchmarks/results" and em.out_dir("d", True, "x") == "d"
  tmp = em.out_dir(None, True, "expert_matmul")  # before: --smoke overwrote the committed H200 results
  assert "expert_matmul_smoke_" in tmp and not tmp.startswith("benchmarks")
