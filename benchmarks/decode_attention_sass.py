"""Static look at the OS-KVP decode kernel's machine code, without a GPU.

Lowers the Pallas kernel to Triton IR on the CPU (as for an H100-class GPU), compiles that IR for sm_90 with a pip
`triton` installed in a separate environment (`python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton`;
not a project dependency), and reads its SASS with the `cuobjdump`/`nvdisasm` Triton ships: registers, stack
(spills), and per warp in the main loop the instructions by kind. Use it to rule out spilling tilings and to count
instructions per token before spending device time; XLA's bundled Triton is a different build, so this is a guide,
not the measurement.

  JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv/bin/python benchmarks/decode_attention_sass.py --triton_python=/tmp/tvenv/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import tempfile

import jax

COMPILE = r"""
import sys, json, os, triton
from triton.backends.compiler import GPUTarget
src, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=ns))
open(src[:-5] + ".cubin", "wb").write(k.asm["cubin"])
print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin"))
"""


def lower_to_ttir(config, shape) -> str:
  """Triton IR (text) of the kernel for `config` at `shape`, lowered on the CPU for an H100-class GPU."""
  from jax._src.pallas.triton import gpu_info, pallas_call_registration as pcr  # pylint: disable=g-import-not-at-top
  from pallas_kernels.oskvp_decode_attention import _oskvp_pallas  # pylint: disable=g-import-not-at-top
  from pallas_kernels.oskvp_random import random_oskvp_inputs_host  # pylint: disable=g-import-not-at-top
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
    args = random_oskvp_inputs_host(0, **shape)
    jax.jit(functools.partial(_oskvp_pallas, interpret=False, config=config)).trace(*args).lower(
        lowering_platforms=("cuda",))
  finally:
    pcr.lowering.lower_jaxpr_to_triton_module, pcr.gpu_info_lib.get_gpu_info = orig, saved_info
  return captured[-1]


def main_loop_stats(sass: str) -> dict:
  """Instruction counts of the longest backward-branch loop (the compressed-token loop)."""
  labels, ins = {}, []
  for ln in sass.splitlines():
    m = re.match(r"^\s*(\.L_x_\d+):", ln)
    if m:
      labels[m.group(1)] = len(ins)
      continue
    m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)
    if m:
      ins.append(m.group(1))
  loops = [(i - labels[m.group(1)] + 1, labels[m.group(1)], i) for i, t in enumerate(ins)
           for m in [re.search(r"BRA\s.*?(\.L_x_\d+)", t)] if m and labels.get(m.group(1), 1 << 30) <= i]
  _, a, b = max(loops)
  body = ins[a:b + 1]
  kinds = {"all": ".", "HMMA": "HMMA|IMMA", "LDL/STL": "LDL|STL", "BAR": "BAR", "LDS/STS": "LDS|STS|LDSM", "SEL": "SEL",
           "LOP3": "LOP3", "ISETP": "ISETP", "PRMT": "PRMT", "LDG": "LDG"}
  return {k: sum(1 for x in body if re.search(p, x)) for k, p in kinds.items()}


def main():
  from pallas_kernels.oskvp_decode_attention import BITPLANE, DecodeBlockConfig  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser()
  ap.add_argument("--triton_python", default="/tmp/tvenv/bin/python")
  ap.add_argument("--out", default=tempfile.mkdtemp(prefix="oskvp_sass_"))
  ap.add_argument("--only", default="", help="compile only the configs whose name contains this")
  args = ap.parse_args()
  shape = dict(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=1024, window=128)
  configs = {
      "timed_first (b128 bcast ns2)": DecodeBlockConfig(block_s=128, num_stages=2, outlier_mma=False),
      "default mma (b64 om ns1)": DecodeBlockConfig(),
      "b64 om ns2": DecodeBlockConfig(num_stages=2),
      "b32 om ns1": DecodeBlockConfig(block_s=32),
      "b32 om ns2": DecodeBlockConfig(block_s=32, num_stages=2),
      "b128 om ns1": DecodeBlockConfig(block_s=128),
      "b64 om ns1 prefetch": DecodeBlockConfig(prefetch=True),
      "b64 om ns1 poly decode": DecodeBlockConfig(decode="poly"),
      "bitplane b64 hp4 d2": DecodeBlockConfig(form="bitplane", block_s=64, num_stages=1, heads_per_program=4),
      "bitplane b64 hp2 d1": DecodeBlockConfig(form="bitplane", block_s=64, num_stages=1, query_digits=1,
                                               heads_per_program=2),
      "bitplane b128 hp1 d2": DecodeBlockConfig(form="bitplane", block_s=128, num_stages=1),
      "bitplane default (b128 hp1 d1)": BITPLANE,
      "bitplane b128 d1 prefetch": dataclasses.replace(BITPLANE, prefetch=True),
      "bitplane b256 d1": dataclasses.replace(BITPLANE, block_s=256),
      "bitplane b128 d1 8 warps": dataclasses.replace(BITPLANE, num_warps=8),
  }
  configs = {k: v for k, v in configs.items() if args.only in k}
  print(f"{'config':30s} regs stack | per warp per block: instrs (per token, all warps) MMA LDL/STL BAR LDS/STS "
        "SEL LOP3 ISETP PRMT")
  for name, cfg in configs.items():
    path = os.path.join(args.out, re.sub(r"\W+", "_", name) + ".ttir")
    with open(path, "w") as f:
      f.write(lower_to_ttir(cfg, shape))
    bindir = subprocess.run([args.triton_python, "-c", COMPILE, path, str(cfg.num_warps), str(cfg.num_stages)],
                            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    cubin = path[:-5] + ".cubin"
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", res.stdout)
    sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    st = main_loop_stats(sass)
    per_tok = st["all"] * cfg.num_warps / cfg.block_s
    print(f"{name:30s} {regs.group(1):>4s} {regs.group(2):>5s} | {st['all']:5d} ({per_tok:5.1f}) {st['HMMA']:4d} "
          f"{st['LDL/STL']:4d} {st['BAR']:3d} {st['LDS/STS']:4d} {st['SEL']:4d} {st['LOP3']:4d} {st['ISETP']:4d} "
          f"{st['PRMT']:4d}")


if __name__ == "__main__":
  main()
