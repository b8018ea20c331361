"""Static look at the OS-KVP decode kernel's machine code, without a GPU.

Lowers the Pallas kernel to Triton IR on the CPU and compiles it for sm_90 with a pip Triton (`triton_sass.py`), then
reports registers, stack (spills), and per warp in the main loop the instructions by kind. Use it to rule out spilling tilings and to count
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
import tempfile

from benchmarks import triton_sass

def lower_oskvp(config, shape, symmetric: bool = False) -> str:
  """Triton IR of the OS-KVP kernel for `config` at `shape` (random inputs drawn on the host)."""
  from pallas_kernels.oskvp_decode_attention import _oskvp_pallas  # pylint: disable=g-import-not-at-top
  from pallas_kernels.oskvp_random import random_oskvp_inputs_host  # pylint: disable=g-import-not-at-top
  return triton_sass.lower_to_ttir(functools.partial(_oskvp_pallas, interpret=False, config=config,
                                                     symmetric_codebooks=symmetric),
                                   *random_oskvp_inputs_host(0, symmetric=symmetric, **shape))


def main_loop_stats(sass: str) -> dict:
  """Instruction counts of the longest backward-branch loop (the compressed-token loop)."""
  ins, found = triton_sass.loops(sass)
  _, a, b = max(found)
  kinds = {"all": ".", "HMMA": "HMMA|IMMA", "LDL/STL": "LDL|STL", "BAR": "BAR", "LDS/STS": "LDS|STS|LDSM", "SEL": "SEL",
           "LOP3": "LOP3", "ISETP": "ISETP", "PRMT": "PRMT", "LDG": "LDG"}
  return triton_sass.count(ins[a:b + 1], kinds)


def main():
  from pallas_kernels.oskvp_decode_attention import BITPLANE, PLAIN_ROWS, DecodeBlockConfig  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser()
  ap.add_argument("--triton_python", default="/tmp/tvenv/bin/python")
  ap.add_argument("--out", default=tempfile.mkdtemp(prefix="oskvp_sass_"))
  ap.add_argument("--only", default="", help="compile only the configs whose name contains this")
  args = ap.parse_args()
  shape = dict(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=1024, window=128)
  plain = PLAIN_ROWS  # the default before compact rows
  compact = dataclasses.replace(BITPLANE, outlier_f16=False, masked_value_planes=False, pallas_prologue=False,
                                values_in_kernel=False)  # run 7's default
  run9 = dataclasses.replace(BITPLANE, pallas_prologue=False, values_in_kernel=False)
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
      "bitplane plain rows b256 d1": plain,
      "bitplane plain rows b128 d1 prefetch": dataclasses.replace(plain, block_s=128, prefetch=True),
      "bitplane plain rows b128 d1 8 warps": dataclasses.replace(plain, block_s=128, num_warps=8),
      "bitplane plain rows symmetric": (plain, True),
      "bitplane compact rows (run 7 default)": compact,
      "bitplane compact rows symmetric": (compact, True),
      "bitplane default (BITPLANE: compact rows, f16 outliers, masked values)": BITPLANE,
      "bitplane default symmetric": (BITPLANE, True),
      "bitplane run 9 default (XLA prologue and merge)": run9,
      "bitplane run 9 default symmetric": (run9, True),
      "bitplane default symmetric, values in kernel": (dataclasses.replace(BITPLANE, values_in_kernel=True), True),
      "bitplane compact rows symmetric b128": (dataclasses.replace(compact, block_s=128), True),
      "bitplane compact rows symmetric 8 warps": (dataclasses.replace(compact, num_warps=8), True),
  }
  configs = {k: v for k, v in configs.items() if args.only in k}
  print(f"{'config':30s} regs stack | per warp per block: instrs (per token, all warps) MMA LDL/STL BAR LDS/STS "
        "SEL LOP3 ISETP PRMT")
  for name, cfg in configs.items():
    cfg, symmetric = cfg if isinstance(cfg, tuple) else (cfg, False)
    path = os.path.join(args.out, re.sub(r"\W+", "_", name) + ".ttir")
    regs, stack, sass = triton_sass.compile_sass(lower_oskvp(cfg, shape, symmetric), path, cfg.num_warps,
                                                 cfg.num_stages, args.triton_python)
    st = main_loop_stats(sass)
    per_tok = st["all"] * cfg.num_warps / cfg.block_s
    print(f"{name:30s} {regs:>4s} {stack:>5s} | {st['all']:5d} ({per_tok:5.1f}) {st['HMMA']:4d} "
          f"{st['LDL/STL']:4d} {st['BAR']:3d} {st['LDS/STS']:4d} {st['SEL']:4d} {st['LOP3']:4d} {st['ISETP']:4d} "
          f"{st['PRMT']:4d}")


if __name__ == "__main__":
  main()
