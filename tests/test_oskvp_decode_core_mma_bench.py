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


def test_sass_loops_found_by_their_mma():
  """`--analyze_dump` reads the loops that hold a warp-level mma (IMMA / HMMA; a wgmma loop has IGMMA / HGMMA) and
  counts their instructions by kind, on disassembly as nvdisasm prints it."""
  from benchmarks import triton_sass  # pylint: disable=g-import-not-at-top
  sass = "\n".join([
      "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
      ".L_x_3:",
      "        /*0010*/                   LDS.64 R4, [R2] ;",
      "        /*0020*/                   LOP3.LUT R6, R4, 0x3030303, RZ, 0xc0, !PT ;",
      "        /*0030*/                   IMMA.16832.S8.S8 R8, R6, R10, R8 ;",
      "        /*0040*/                   MUFU.EX2 R12, R12 ;",
      "        /*0050*/              @P0 BRA `(.L_x_3) ;",
      ".L_x_4:",
      "        /*0060*/                   FADD R1, R1, R2 ;",
      "        /*0070*/              @P1 BRA `(.L_x_4) ;",
  ])
  loops = triton_sass.wgmma_loops(sass, bench.SASS_KINDS, marker=r"\b[IH]MMA")
  assert len(loops) == 1
  assert loops[0]["length"] == 5
  assert (loops[0]["IMMA"], loops[0]["LDS"], loops[0]["LOP3"], loops[0]["MUFU"], loops[0]["HMMA"]) == (1, 1, 1, 1, 0)
  assert not triton_sass.wgmma_loops(sass, bench.SASS_KINDS)  # no wgmma in either loop


def test_analyze_dump_compiles_each_ptx_and_reads_its_loops(tmp_path):
  """`analyze_dump` (`triton_sass.analyze_ptx_dump`) runs ptxas and nvdisasm on each `*.ptx` of the folder, keeps the
  report's register line and counts the mma loop; a kernel ptxas rejects keeps its report and has no loops. The two
  tools are stand-in scripts here (the real ones need a CUDA install)."""
  dump = tmp_path / "dump"
  dump.mkdir()
  (dump / "good.ptx").write_text("ok")
  (dump / "bad.ptx").write_text("fail")
  ptxas = tmp_path / "ptxas"  # ptxas -arch=... -v X.ptx -o X.cubin
  ptxas.write_text('#!/bin/sh\nif grep -q fail "$3"; then echo "ptxas error : bad" >&2; exit 1; fi\n'
                   'echo "ptxas info    : Used 115 registers"; cp "$3" "$5"\n')
  nvdisasm = tmp_path / "nvdisasm"
  nvdisasm.write_text("#!/bin/sh\ncat <<'S'\n.L_x_1:\n        /*0010*/                   IMMA.16832.S8.S8 R8, R6, R10, "
                      "R8 ;\n        /*0020*/                   LOP3.LUT R6, R4, 0x3, RZ, 0xc0, !PT ;\n"
                      "        /*0030*/              @P0 BRA `(.L_x_1) ;\nS\n")
  for tool in (ptxas, nvdisasm):
    tool.chmod(0o755)
  rep = bench.analyze_dump(str(dump), ptxas=str(ptxas), nvdisasm=str(nvdisasm))
  assert sorted(rep) == ["bad", "good"]
  assert rep["good"]["ptxas"] == ["ptxas info    : Used 115 registers"]
  assert [(lp["length"], lp["IMMA"], lp["LOP3"]) for lp in rep["good"]["loops"]] == [(3, 1, 1)]
  assert (dump / "good.sass").exists()
  assert rep["bad"]["ptxas"] == ["ptxas error : bad"] and "loops" not in rep["bad"]
