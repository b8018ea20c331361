"""Reading a Pallas (Triton) kernel's machine code without a GPU: the shared half of the `*_sass.py` tools.

Lowers a jitted function's last Pallas kernel to Triton IR on the CPU (as for an H100-class GPU), compiles that IR
for sm_90 with a pip `triton` in a separate environment (`python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install
triton`; not a project dependency), and disassembles it with the `cuobjdump`/`nvdisasm` Triton ships. XLA's bundled
Triton is a different build, so what this shows is a guide, not the measurement.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

import jax

# Run by the pip Triton's Python: compiles <src>.ttir, writes <src>.cubin/.ttgir/.ptx, prints Triton's nvidia bin dir.
COMPILE = r"""
import sys, os, triton
from triton.backends.compiler import GPUTarget
src, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=ns))
base = src[:-5]
open(base + ".cubin", "wb").write(k.asm["cubin"])
open(base + ".ttgir", "w").write(k.asm["ttgir"])
open(base + ".ptx", "w").write(k.asm["ptx"])
print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin"))
"""


TVENV = "/tmp/tvenv"  # where the module docstring's set-up puts the pip Triton
TVENV_SETUP = f"python3 -m venv {TVENV} && {TVENV}/bin/pip install triton"


def triton_tool(name: str, tvenv: str = TVENV) -> str:
  """Path of a CUDA tool (`nvdisasm`, `cuobjdump`) that the pip Triton in `tvenv` ships, for any Python 3 minor.

  Raises:
    FileNotFoundError: no pip Triton there; the message gives the set-up command.
  """
  found = sorted(glob.glob(os.path.join(tvenv, "lib", "python3*", "site-packages", "triton", "backends", "nvidia",
                                        "bin", name)))
  if not found:
    raise FileNotFoundError(f"no {name} from a pip Triton under {tvenv}: make that environment with `{TVENV_SETUP}`")
  return found[-1]


def lower_to_ttir(fn, *args) -> str:
  """Triton IR (text) of the last Pallas kernel in jitted `fn(*args)`, lowered on the CPU for an H100-class GPU."""
  from jax._src.pallas.triton import gpu_info, pallas_call_registration as pcr  # pylint: disable=g-import-not-at-top
  captured = []
  orig = pcr.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    res = orig(*a, **k)
    captured.append(res.module.operation.get_asm(enable_debug_info=False))
    return res

  h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  pcr.lowering.lower_jaxpr_to_triton_module, saved_info = capture, pcr.gpu_info_lib.get_gpu_info
  pcr.gpu_info_lib.get_gpu_info = lambda: h100
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    pcr.lowering.lower_jaxpr_to_triton_module, pcr.gpu_info_lib.get_gpu_info = orig, saved_info
  return captured[-1]


def compile_sass(ttir: str, path: str, num_warps: int, num_stages: int, triton_python: str) -> tuple[str, str, str]:
  """Writes `ttir` to `path` (…/name.ttir), compiles it beside it; returns (registers, stack bytes, SASS text).

  Raises:
    RuntimeError: the pip Triton failed to compile (message: its last stderr line).
  """
  if not os.path.exists(triton_python):
    raise FileNotFoundError(f"--triton_python={triton_python} does not exist: make it with `{TVENV_SETUP}` (a pip "
                            "Triton, not a project dependency)")
  with open(path, "w") as f:
    f.write(ttir)
  r = subprocess.run([triton_python, "-c", COMPILE, path, str(num_warps), str(num_stages)], capture_output=True,
                     text=True)
  if r.returncode:
    raise RuntimeError(r.stderr.strip().splitlines()[-1][:200])
  bindir = r.stdout.strip().splitlines()[-1]
  cubin = path[:-5] + ".cubin"
  res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True)
  regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", res.stdout).groups()
  sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
  with open(path[:-5] + ".sass", "w") as f:
    f.write(sass)
  return regs, stack, sass


def loops(sass: str) -> tuple[list[str], list[tuple[int, int, int]]]:
  """(instructions, loops): every backward branch as (length, first index, branch index) into the instructions."""
  labels, ins = {}, []
  for ln in sass.splitlines():
    m = re.match(r"^\s*(\.L_x_\d+):", ln)
    if m:
      labels[m.group(1)] = len(ins)
      continue
    m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)
    if m:
      ins.append(m.group(1))
  found = [(i - labels[m.group(1)] + 1, labels[m.group(1)], i) for i, t in enumerate(ins)
           for m in [re.search(r"BRA\s.*?(\.L_x_\d+)", t)] if m and labels.get(m.group(1), 1 << 30) <= i]
  return ins, found


def count(body: list[str], kinds: dict[str, str]) -> dict[str, int]:
  """Instructions of `body` matching each kind's regex."""
  return {k: sum(1 for x in body if re.search(p, x)) for k, p in kinds.items()}


def wgmma_loops(sass: str, kinds: dict[str, str], marker: str = r"[HI]GMMA") -> list[dict]:
  """The loops of `sass` that hold a wgmma (HGMMA or, for int8, IGMMA; or another instruction `marker` matches, e.g.
  the warp-level IMMA / HMMA), longest first: {"length", **count(kinds)}."""
  ins, found = loops(sass)
  out = []
  for length, a, b in sorted(found, reverse=True):
    body = ins[a:b + 1]
    if any(re.search(marker, x) for x in body):
      out.append({"length": length, **count(body, kinds)})
  return out


def ptxas_lines(report: str) -> list[str]:
  """The lines of a ptxas `-v` report that matter here: registers, spills, stack, warnings and errors."""
  return [ln.strip() for ln in report.splitlines() if re.search(r"warn|Used|spill|stack|error", ln, re.I)]


def analyze_ptx_dump(path: str, kinds: dict[str, str], marker: str = r"[HI]GMMA", ptxas: str = "ptxas",
                     nvdisasm: str | None = None) -> dict[str, dict]:
  """Without a GPU: each `*.ptx` of a MOSAIC_GPU_DUMP_TO folder compiled here (`ptxas -arch=sm_90a -v`, then
  nvdisasm; the `.cubin` and `.sass` are written beside it) -> {kernel name: {"ptxas": `ptxas_lines` of its report,
  "loops": `wgmma_loops(sass, kinds, marker)`}}, "loops" absent where ptxas failed."""
  out = {}
  for ptx in sorted(glob.glob(os.path.join(path, "*.ptx"))):
    base = ptx[:-4]
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", base + ".cubin"], capture_output=True, text=True)
    rep = {"ptxas": ptxas_lines(r.stdout + r.stderr)}
    if not r.returncode:
      sass = subprocess.run([nvdisasm or triton_tool("nvdisasm"), "-c", base + ".cubin"], capture_output=True,
                            text=True, check=True).stdout
      with open(base + ".sass", "w") as fh:
        fh.write(sass)
      rep["loops"] = wgmma_loops(sass, kinds, marker)
    out[os.path.basename(base)] = rep
  return out
