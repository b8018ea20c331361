"""Static look at the int4 / vq2 grouped-matmul kernels' machine code, without a GPU.

Lowers each kernel variant to Triton IR on the CPU and compiles it for sm_90 with a pip Triton (`triton_sass.py`),
then reports per variant: the MMA kind the tensor cores run (HMMA = mma.sync, HGMMA = wgmma), registers,
spills, and in the K loop per weight the instructions by kind, plus where the layout conversions sit in the Triton
GPU IR (a `convert_layout`/`local_alloc` of the unpacked bf16 tile means the dequantized weight goes through shared
memory; of the packed i8 tile, that only the packed bytes do). XLA's bundled Triton is a different build, so this is
a guide, not the measurement.

  JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv/bin/python benchmarks/expert_matmul_sass.py \
      --triton_python=/tmp/tvenv/bin/python
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import tempfile

import jax
import jax.numpy as jnp

from benchmarks import triton_sass
from pallas_kernels import int4_grouped_matmul as i4
from pallas_kernels import vq2_grouped_matmul as v2

def loop_stats(sass: str) -> dict:
  """Instruction counts of the K-group loop: the smallest backward-branch loop that holds a tensor-core op."""
  ins, found = triton_sass.loops(sass)
  _, a, b = min(lp for lp in found if any("MMA" in t for t in ins[lp[1]:lp[2] + 1]))
  kinds = {"all": ".", "HMMA": r"\bHMMA", "HGMMA": "HGMMA", "LDL/STL": r"\bLDL|\bSTL", "BAR": r"\bBAR",
           "STS": r"\bSTS", "LDS": r"\bLDS\b|\bLDS\.", "LDSM": "LDSM", "LDG": r"\bLDG", "PRMT": "PRMT",
           "LOP3": "LOP3", "I2F/F2F": r"I2F|F2F|F2I", "FFMA/FMUL/FADD": r"\bFFMA|\bFMUL|\bFADD", "SHFL": "SHFL"}
  return triton_sass.count(ins[a:b + 1], kinds)


def variants(e=64, k=4096, n=2048, rows_per_expert=16):
  """(name, fn, args, num_warps, num_stages, weights per K-loop iteration) for the kernels at one decode shape."""
  from benchmarks.expert_matmul import random_int4, random_vq2  # pylint: disable=g-import-not-at-top
  key = jax.random.key(0)
  gs = jnp.full((e,), rows_per_expert, jnp.int32)
  x = jnp.zeros((e * rows_per_expert, k), jnp.bfloat16)
  w4, wv = random_int4(key, e, k, n), random_vq2(key, e, k, n)
  w4nk = i4.to_nk_layout(w4)
  out = []
  for bn in (128, 256):
    cfg = dict(block_n=bn, num_warps=4, num_stages=3, unpack="asm")
    out.append((f"int4 x@W u8 bn{bn}", functools.partial(i4.int4_grouped_matmul, **cfg), (x, w4, gs), 4, 3,
                128 * bn))
  for bn, bm, nw in ((128, 16, 4), (128, 8, 4), (256, 16, 4), (256, 8, 4), (256, 16, 8), (256, 8, 8), (512, 8, 8)):
    cfg = dict(block_n=bn, block_m=bm, num_warps=nw, num_stages=3, unpack="asm", split_k=1)
    out.append((f"int4 swap u16 bn{bn} bm{bm} w{nw}", functools.partial(i4.int4_grouped_matmul, **cfg),
                (x, w4nk, gs), nw, 3, 128 * bn))
  out.append(("vq2 x@W bn256", functools.partial(v2.vq2_grouped_matmul, block_n=256), (x, wv, gs), 4, 3,
              128 * 256))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--triton_python", default="/tmp/tvenv/bin/python")
  ap.add_argument("--out", default=tempfile.mkdtemp(prefix="expert_sass_"))
  ap.add_argument("--only", default="", help="substring of the variant names to run")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  print(f"IR and SASS under {args.out}")
  print(f"{'variant':28s} regs stack | loop: instrs (per weight) HMMA HGMMA LDL/STL BAR STS LDS LDSM LDG PRMT LOP3 "
        "I2F FP | cvt/alloc in TTGIR")
  for name, fn, fargs, nw, ns, per_iter in variants():
    if args.only and args.only not in name:
      continue
    path = os.path.join(args.out, re.sub(r"\W+", "_", name) + ".ttir")
    try:
      regs, stack, sass = triton_sass.compile_sass(triton_sass.lower_to_ttir(fn, *fargs), path, nw, ns,
                                                   args.triton_python)
    except RuntimeError as e:
      print(f"{name:28s} compile failed: {e}")
      continue
    st = loop_stats(sass)
    ttgir = open(path[:-5] + ".ttgir").read()
    cvts = sorted(set(re.findall(r"(?:convert_layout|local_alloc)[^\n]*?-> !?t?t?g?\.?(?:memdesc|tensor)<(\d+x\d+x\w+)",
                                 ttgir)))
    per_w = st["all"] * nw * 32 / per_iter
    print(f"{name:28s} {regs:>4s} {stack:>5s} | {st['all']:5d} ({per_w:5.2f}) {st['HMMA']:4d} "
          f"{st['HGMMA']:5d} {st['LDL/STL']:4d} {st['BAR']:3d} {st['STS']:3d} {st['LDS']:3d} {st['LDSM']:4d} "
          f"{st['LDG']:3d} {st['PRMT']:4d} {st['LOP3']:4d} {st['I2F/F2F']:3d} {st['FFMA/FMUL/FADD']:3d} | "
          f"{' '.join(cvts)}")


if __name__ == "__main__":
  main()
