"""Key and value sides of the Mosaic GPU OS-KVP decode attention on the H200: correctness, then cycles per token-head.

Run on the H200:  PYTHONPATH=$PWD python3 benchmarks/oskvp_key_scores_mgpu_bench.py --out=$OUT
CPU smoke test:   PYTHONPATH=$PWD python3 benchmarks/oskvp_key_scores_mgpu_bench.py --smoke --out=/tmp/ks_smoke
CPU lowering of every timed config (key and value) at its real shape:  ... --lower-only

1. Checks (`pallas_kernels/oskvp_key_scores_mgpu.py`): the one-block kernel and the sequence-loop kernel (outputs
   "scores" and "max"), planes from registers and through shared memory, against the jnp reference on random codes
   and digits at a few shapes, exact int32. Any mismatch or compile error stops the run before timing (exit 1)
   unless --time-on-mismatch.
2. Timing: CUPTI kernel time (`mosaic.gpu.profiler.measure(..., aggregate=False)`, summed over the call's kernels,
   median over --iters calls, L2 flushed before each) of the loop kernel at BK = 64 (batch 8 × 8 kv heads),
   S = 65536 and 16384, Q = 32 (H = 128), N = 8 and 16, plane types 3 and 2, a few block sizes / splits / ring
   depths, A from registers vs shared memory (CONFIGS below, most important first; configs past --budget-s are
   skipped); and at S = 16384 without the flush (codes L2-resident: the compute side's cost).
3. Per config: µs, code bytes read (BK·S·Q), TB/s, and
     cycles per token and kv head = µs · f_MHz · SMs / (BK · S)
   (SM-cycles of the whole GPU per token-head), with SMs from jax (`device.core_count`) and f from nvidia-smi's
   max SM clock, else the H200's 132 SMs and 1980 MHz; next to the 6.7 cycles per token-head that the 0.108 ms
   target (issue #5: 64k context × batch 8 × 8 kv heads) leaves for the whole attention, and to the HBM floor of
   the code bytes alone at 4.8 TB/s.
4. Value side (`pallas_kernels/oskvp_value_sums_mgpu.py`, `value_sums_mgpu`): checked exactly against
   `value_sums_split_reference` on both A routes at a few shapes (VALUE_CHECKS, with the key checks and before any
   timing; a failure of either side stops the run the same way), then timed the same way at BK = 64, S = 65536 (and
   one 16384 row): T 3/2, N 8/16, block 64/128, splits 8/16/32, A registers vs smem (VALUE_CONFIGS). V-code bytes =
   BK·S·Q (token-contiguous [BK, Q, S]), same cycles formula; `main µs` is the largest single kernel (the Mosaic
   kernel without the wrapper's tiny output permutation). Key and value configs are interleaved by priority
   (SCHEDULE: the 6 first key configs, the 4 first value configs, the rest of the S = 65536 key configs, the rest of
   the value configs, the S = 16384 key rows), all under the one --budget-s.
5. Writes oskvp_key_scores_mgpu.{md,json} under --out (device, jax version, date; a separate value-side section),
   rewritten after every check and config so that a run cut short keeps what it measured.

Machine code: `MOSAIC_GPU_DUMP_TO=<dir> ... --dump=I` compiles and runs DUMP_CONFIGS[I] once on the GPU (one process
per config, so each dump folder holds one kernel's PTX and ptxas report); `--analyze-dump=<dir>[,<dir>...]` then runs
here, without a GPU: it compiles each dumped PTX with ptxas for sm_90a, disassembles it with nvdisasm (Triton's, as in
`triton_sass.py`), and counts the SASS of the loop that holds the block's wgmmas, per token-head.

--smoke: interpret mode on the CPU at tiny shapes (the interpreter takes A from shared memory on both routes), with
wall-clock "timing" of one tiny config only to exercise the report; the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import oskvp_key_scores_mgpu as ks
from pallas_kernels import oskvp_value_sums_mgpu as vs

Q = 32  # code bytes per token and kv head (H = 128)
BK = 64  # batch 8 × 8 kv heads
TARGET_CYCLES = 6.7  # 132 SMs × 1.98 GHz × 0.108 ms / (8 × 8 × 65536) token-heads: the whole attention's budget
HBM_TBPS = 4.8  # H200 HBM3e peak, for the bytes floor
DEFAULT_SMS, DEFAULT_MHZ = 132, 1980.0

warnings.filterwarnings("ignore", category=DeprecationWarning)


@dataclasses.dataclass(frozen=True)
class _Timed:
  """The fields a timed call of either side shares (at BK = 64)."""
  s: int
  n: int = 8
  plane_types: int = 3
  block_s: int = 64
  splits: int = 16
  a_operand: str = "registers"
  steps: int = 4  # TMA ring depth
  flush: bool = True  # False: L2 not flushed, the codes of S = 16384 (33.5 MB) stay in the 50 MB L2

  def _fields(self) -> str:
    return f"S={self.s} N={self.n} T={self.plane_types} bs={self.block_s}"

  @property
  def _warm(self) -> str:
    return "" if self.flush else " L2-warm"


@dataclasses.dataclass(frozen=True)
class Config(_Timed):
  """One timed key-side call: the loop kernel (or the one-block kernel, kernel="block")."""
  output: str = "max"
  kernel: str = "loop"

  @property
  def name(self) -> str:
    if self.kernel == "block":
      return f"block {self._fields()} A={self.a_operand}{self._warm}"
    return (f"loop {self._fields()} splits={self.splits} ring={self.steps} A={self.a_operand} out={self.output}"
            f"{self._warm}")


_L = 65536
CONFIGS = [  # most important first: the run stops adding configs at --budget-s
    Config(_L, splits=16),
    Config(_L, splits=8),
    Config(_L, splits=32),
    Config(_L, splits=16, a_operand="smem"),
    Config(_L, splits=16, plane_types=2),
    Config(_L, splits=16, plane_types=2, a_operand="smem"),
    Config(_L, splits=16, n=16),
    Config(_L, splits=16, n=16, plane_types=2),
    Config(_L, splits=16, n=16, a_operand="smem"),
    Config(_L, splits=16, block_s=128),
    Config(_L, splits=16, block_s=128, plane_types=2),
    Config(_L, splits=16, steps=2),
    Config(_L, splits=16, steps=8),
    Config(_L, splits=64),
    Config(_L, splits=16, output="scores"),
    Config(_L, kernel="block", output="scores"),
    Config(16384, splits=4),
    Config(16384, splits=8),
    Config(16384, splits=4, a_operand="smem"),
    Config(16384, splits=4, plane_types=2),
    Config(16384, splits=4, n=16),
    # Codes L2-resident (no flush between calls): the compute side's cost without the HBM stream.
    Config(16384, splits=4, flush=False),
    Config(16384, splits=4, a_operand="smem", flush=False),
    Config(16384, splits=4, plane_types=2, flush=False),
]

# (kernel, BK, S, N, T, block_s, splits, output, ring) checked on the GPU for both A routes.
CHECKS = [("block", 2, 256, 8, 3, 64, 1, "scores", 1), ("block", 1, 512, 16, 2, 128, 1, "scores", 1),
          ("loop", 4, 4096, 8, 3, 64, 4, "scores", 4), ("loop", 4, 4096, 8, 3, 64, 4, "max", 4),
          ("loop", 2, 2048, 16, 2, 128, 2, "max", 3), ("loop", 3, 3072, 8, 2, 64, 3, "max", 2),
          ("loop", 2, 8192, 16, 3, 64, 1, "scores", 8), ("block", 2, 256, 8, 1, 64, 1, "scores", 1),
          ("loop", 4, 4096, 8, 1, 64, 4, "max", 4), ("loop", 2, 2048, 16, 1, 128, 2, "scores", 3)]
SMOKE_CHECKS = [("block", 1, 128, 8, 3, 64, 1, "scores", 1), ("loop", 1, 256, 8, 3, 64, 2, "scores", 2),
                ("loop", 2, 256, 16, 2, 64, 2, "max", 2)]


@dataclasses.dataclass(frozen=True)
class ValueConfig(_Timed):
  """One timed `value_sums_mgpu` call: p int8 [BK, N, S], V codes uint8 [BK, Q, S]."""

  @property
  def name(self) -> str:
    return f"value {self._fields()} splits={self.splits} ring={self.steps} A={self.a_operand}{self._warm}"


VALUE_CONFIGS = [  # most important first
    ValueConfig(_L),
    ValueConfig(_L, a_operand="smem"),
    ValueConfig(_L, plane_types=2),
    ValueConfig(_L, n=16),
    ValueConfig(_L, block_s=128),
    ValueConfig(_L, splits=8),
    ValueConfig(_L, splits=32),
    ValueConfig(_L, plane_types=2, a_operand="smem"),
    ValueConfig(_L, n=16, plane_types=2, block_s=128),
    ValueConfig(16384, splits=4),
]
# T = 1 (uniform codebooks: the codes themselves as the int8 A operand), key then value.
UNIFORM_CONFIGS = [
    Config(_L, plane_types=1), ValueConfig(_L, plane_types=1),
    Config(_L, plane_types=1, splits=32), Config(_L, plane_types=1, block_s=128),
    ValueConfig(_L, plane_types=1, block_s=128), ValueConfig(_L, plane_types=1, splits=32),
    Config(_L, plane_types=1, n=16), ValueConfig(_L, plane_types=1, n=16),
    Config(_L, plane_types=1, a_operand="smem"), ValueConfig(_L, plane_types=1, a_operand="smem"),
    Config(16384, splits=4, plane_types=1), Config(16384, splits=4, plane_types=1, flush=False),
]
# Key and value configs in one priority order under --budget-s (the S = 16384 key rows last).
SCHEDULE = (CONFIGS[:6] + VALUE_CONFIGS[:4] + UNIFORM_CONFIGS[:6] + CONFIGS[6:16] + VALUE_CONFIGS[4:]
            + UNIFORM_CONFIGS[6:] + CONFIGS[16:])

# (BK, S, N, T, block_s, splits, ring) of value_sums_mgpu, checked on the GPU for both A routes.
VALUE_CHECKS = [(2, 256, 8, 3, 64, 1, 2), (4, 4096, 8, 3, 64, 4, 4), (2, 2048, 16, 2, 128, 2, 3),
                (3, 3072, 16, 3, 128, 3, 2), (2, 8192, 8, 2, 64, 1, 8), (4, 4096, 8, 1, 64, 4, 4),
                (2, 2048, 16, 1, 128, 2, 3)]
SMOKE_VALUE_CHECKS = [(1, 128, 8, 3, 64, 1, 2), (2, 256, 16, 2, 64, 2, 2)]


# --dump=I: the configs whose machine code is read (S = 65536 register route, T 3/2, key then value).
DUMP_CONFIGS = [Config(_L), Config(_L, plane_types=2), ValueConfig(_L), ValueConfig(_L, plane_types=2)]
SASS_KINDS = {"all": ".", "IGMMA/HGMMA": "[HI]GMMA", "WARPGROUP": "WARPGROUP", "LDSM": "LDSM", "LDS": r"LDS\b|LDS\.",
              "STS": "STS", "LOP3": "LOP3", "SHF/SHR/SHL": r"SHF|SHR|SHL", "PRMT": "PRMT", "IMAD/IADD": "IMAD|IADD",
              "IMNMX/VIMNMX": "IMNMX", "MOV": r"\bMOV", "SYNCS/BAR": "SYNCS|BAR", "LDL/STL": "LDL|STL",
              "BRA": "BRA", "DEPBAR/WAIT": "DEPBAR|WARPSYNC|WAIT"}
def dump(index: int) -> int:
  """Compiles and runs DUMP_CONFIGS[index] once at its real shape (run with MOSAIC_GPU_DUMP_TO set)."""
  cfg = DUMP_CONFIGS[index]
  if isinstance(cfg, ValueConfig):
    fn, args = value_fn(plane_types=cfg.plane_types, block_s=cfg.block_s, splits=cfg.splits,
                        a_operand=cfg.a_operand, steps=cfg.steps, interpret=False), value_inputs(0, BK, cfg.s, cfg.n)
  else:
    fn = kernel_fn(cfg.kernel, block_s=cfg.block_s, splits=cfg.splits, output=cfg.output, a_operand=cfg.a_operand,
                   steps=cfg.steps, interpret=False)
    args = inputs(0, BK, cfg.s, cfg.n, cfg.plane_types)
  jax.block_until_ready(fn(*args))
  if os.environ.get("MOSAIC_GPU_DUMP_TO"):
    with open(os.path.join(os.environ["MOSAIC_GPU_DUMP_TO"], "config.txt"), "w") as fh:
      fh.write(cfg.name + "\n")
  print("dumped", cfg.name, flush=True)
  return 0


def analyze_dump(path: str, ptxas: str = "ptxas", nvdisasm: str | None = None) -> dict:
  """ptxas's report and the wgmma loop's SASS counts (per token-head) of each `*.ptx` under one dump folder.

  A thread of the one warpgroup handles block_s tokens × the BK row's heads per loop trip; per token-head the loop's
  warp instructions are 4 warps × its length / block_s (the folder's config is read from its `config.txt`).
  """
  import re  # pylint: disable=g-import-not-at-top
  from benchmarks import triton_sass  # pylint: disable=g-import-not-at-top
  block_s = 64
  cfg_txt = os.path.join(path, "config.txt")
  if os.path.exists(cfg_txt):
    m = re.search(r"bs=(\d+)", open(cfg_txt).read())
    block_s = int(m.group(1)) if m else block_s
  out = triton_sass.analyze_ptx_dump(path, SASS_KINDS, ptxas=ptxas, nvdisasm=nvdisasm)
  for rep in out.values():
    if "loops" in rep:  # absent where ptxas failed
      rep["loops"] = [{"warp_instr_per_token_head": round(4 * lp["length"] / block_s, 2), **lp} for lp in rep["loops"]]
  return out


def inputs(seed: int, bk: int, s: int, n: int, plane_types: int):
  """Random codes uint8 [BK, S, Q] and digits int8 [BK, N, T·4Q] (the full int8 range)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  codes = jax.random.bits(k1, (bk, s, Q), jnp.uint8)
  qd = jax.random.randint(k2, (bk, n, plane_types * 4 * Q), -128, 128).astype(jnp.int8)
  return codes, qd


def value_inputs(seed: int, bk: int, s: int, n: int):
  """Random probability digits int8 [BK, N, S] (the full int8 range) and token-contiguous V codes uint8 [BK, Q, S]."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  vcodes = vs.token_contiguous(jax.random.bits(k1, (bk, s, Q), jnp.uint8))  # the cache's [BK, S, Q], transposed
  p = jax.random.randint(k2, (bk, n, s), -128, 128).astype(jnp.int8)
  return p, vcodes


def value_fn(*, plane_types: int, block_s: int, splits: int, a_operand: str, steps: int, interpret: bool):
  return jax.jit(lambda p, v: vs.value_sums_mgpu(p, v, plane_types=plane_types, block_s=block_s, splits=splits,
                                                 a_operand=a_operand, max_concurrent_steps=steps,
                                                 interpret=interpret))


def kernel_fn(kernel: str, *, block_s: int, splits: int, output: str, a_operand: str, steps: int, interpret: bool):
  if kernel == "block":
    return jax.jit(lambda c, q: ks.key_scores_mgpu(c, q, block_s=block_s, a_operand=a_operand, interpret=interpret))
  return jax.jit(lambda c, q: ks.key_scores_mgpu_loop(c, q, block_s=block_s, splits=splits, output=output,
                                                      a_operand=a_operand, max_concurrent_steps=steps,
                                                      interpret=interpret))


def lower_for_cuda(cfg: Config | ValueConfig) -> None:
  """Traces and lowers the config's GPU kernel for CUDA at its real shapes (no device or data needed)."""
  if isinstance(cfg, ValueConfig):
    p = jax.ShapeDtypeStruct((BK, cfg.n, cfg.s), jnp.int8)
    vcodes = jax.ShapeDtypeStruct((BK, Q, cfg.s), jnp.uint8)
    fn = value_fn(plane_types=cfg.plane_types, block_s=cfg.block_s, splits=cfg.splits, a_operand=cfg.a_operand,
                  steps=cfg.steps, interpret=False)
    fn.trace(p, vcodes).lower(lowering_platforms=("cuda",))
    return
  codes = jax.ShapeDtypeStruct((BK, cfg.s, Q), jnp.uint8)
  qd = jax.ShapeDtypeStruct((BK, cfg.n, cfg.plane_types * 4 * Q), jnp.int8)
  fn = kernel_fn(cfg.kernel, block_s=cfg.block_s, splits=cfg.splits, output=cfg.output, a_operand=cfg.a_operand,
                 steps=cfg.steps, interpret=False)
  fn.trace(codes, qd).lower(lowering_platforms=("cuda",))


def _compare(row: dict, compute, want: np.ndarray) -> dict:
  """row + the exact comparison of compute() (the kernel's output) with want: ok, mismatch count, first mismatch."""
  try:
    got = np.asarray(compute())
  except Exception as e:  # pylint: disable=broad-except
    return {**row, "ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
  if got.shape != want.shape:
    return {**row, "ok": False, "error": f"shape {got.shape} != reference {want.shape}"}
  bad = got != want
  row = {**row, "ok": not bad.any(), "mismatches": int(bad.sum()), "elements": int(bad.size)}
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    row.update(first_mismatch=list(first), got=int(got[first]), want=int(want[first]))
  return row


def run_check(case, a_operand: str, interpret: bool) -> dict:
  kernel, bk, s, n, t, block_s, splits, output, steps = case
  row = {"kernel": kernel, "bk": bk, "s": s, "n": n, "plane_types": t, "block_s": block_s, "splits": splits,
         "output": output, "ring": steps, "a_operand": a_operand}
  codes, qd = inputs(bk * s + n + t + splits, bk, s, n, t)
  want = np.asarray(ks.key_scores_reference(codes, qd) if output == "scores"
                    else ks.key_scores_max_reference(codes, qd, splits))
  fn = lambda: kernel_fn(kernel, block_s=block_s, splits=splits, output=output, a_operand=a_operand, steps=steps,
                         interpret=interpret)(codes, qd)
  return _compare(row, fn, want)


def run_value_check(case, a_operand: str, interpret: bool) -> dict:
  bk, s, n, t, block_s, splits, steps = case
  row = {"kernel": "value", "bk": bk, "s": s, "n": n, "plane_types": t, "block_s": block_s, "splits": splits,
         "ring": steps, "a_operand": a_operand}
  p, vcodes = value_inputs(bk * s + n + t + splits + 1, bk, s, n)
  want = np.asarray(vs.value_sums_split_reference(p, vcodes, splits, t))
  fn = lambda: value_fn(plane_types=t, block_s=block_s, splits=splits, a_operand=a_operand, steps=steps,
                        interpret=interpret)(p, vcodes)
  return _compare(row, fn, want)  # first_mismatch indexes [bk, split, type, channel, n]


def device_constants(smoke: bool) -> tuple[int, float, str, str]:
  """(SM count, SM clock MHz, where each came from)."""
  sms, sms_src = DEFAULT_SMS, "constant"
  mhz, mhz_src = DEFAULT_MHZ, "constant"
  if smoke:
    return sms, mhz, sms_src, mhz_src
  cores = getattr(jax.devices()[0], "core_count", 0)
  if cores:
    sms, sms_src = int(cores), "jax device.core_count"
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    mhz, mhz_src = float(out.splitlines()[0]), "nvidia-smi clocks.max.sm"
  except Exception:  # pylint: disable=broad-except
    pass
  return sms, mhz, sms_src, mhz_src


def kernel_ms(fn, args, iters: int, smoke: bool, flush_l2: bool = True) -> tuple[float, list[str], float]:
  """Median over `iters` calls of the summed kernel time (ms) of one call, L2 flushed before each (flush_l2).

  Returns (median total ms, the call's kernel names, median ms of its largest single kernel).
  """
  if smoke:  # no CUPTI on the CPU: wall clock, only to exercise the report
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), ["(cpu wall clock)"], statistics.median(times)
  calls = call_timings(fn, args, iters, flush_l2)
  return (statistics.median(sum(ms for _, ms in t) for t in calls), [n for n, _ in calls[-1]],
          statistics.median(max(ms for _, ms in t) for t in calls))


def call_timings(fn, args, iters: int, flush_l2: bool = True) -> list[list[tuple[str, float]]]:
  """CUPTI (kernel name, ms) of every kernel of `iters` calls of fn(*args), one list per call; L2 flushed by a
  256 MB write before each call (flush_l2), else warmed by an untimed call."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  flush_buf = jnp.zeros((64 << 20,), jnp.float32)  # 256 MB > the 50 MB L2
  flush = jax.jit(lambda b: b + 1.0)
  calls = []
  for _ in range(iters):
    if flush_l2:
      flush_buf = jax.block_until_ready(flush(flush_buf))
    else:
      jax.block_until_ready(fn(*args))  # the previous call leaves the codes in L2
    calls.append(profiler.measure(fn, aggregate=False)(*args)[1])
  return calls


def _cached_inputs(args_cache: dict, key: tuple, make):
  """One input set on the device at a time: the cached one if `key` matches, else make() (the old one dropped)."""
  if key not in args_cache:
    args_cache.clear()
    args_cache[key] = jax.block_until_ready(make())
  return args_cache[key]


def _timed_row(cfg, fn, args, *, bk: int, extra_bytes: dict, iters: int, sms: int, mhz: float, smoke: bool) -> dict:
  """Compiles and times fn(*args) (`kernel_ms`) -> the config's report row, in µs and cycles per token-head."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))  # compile
  compile_s = time.perf_counter() - t0
  ms, names, main_ms = kernel_ms(fn, args, iters, smoke, cfg.flush)
  us, main_us = ms * 1e3, main_ms * 1e3
  code_bytes = bk * cfg.s * Q
  per = mhz * sms / (bk * cfg.s)  # µs → cycles per token-head
  return {"config": cfg.name, **dataclasses.asdict(cfg), "bk": bk, "us": us, "main_us": main_us,
          "code_bytes": code_bytes, **extra_bytes, "tbps_codes": code_bytes / us / 1e6,
          "cycles_per_token_head": us * per, "main_cycles_per_token_head": main_us * per,
          "share_of_target": us * per / TARGET_CYCLES, "hbm_floor_cycles": code_bytes / (HBM_TBPS * 1e6) * per,
          "compile_s": compile_s, "kernels": names}


def time_config(cfg: Config, args_cache: dict, iters: int, sms: int, mhz: float, smoke: bool) -> dict:
  bk = 2 if smoke else BK
  codes, qd = _cached_inputs(args_cache, (bk, cfg.s, cfg.n, cfg.plane_types),
                             lambda: inputs(0, bk, cfg.s, cfg.n, cfg.plane_types))
  fn = kernel_fn(cfg.kernel, block_s=cfg.block_s, splits=cfg.splits, output=cfg.output, a_operand=cfg.a_operand,
                 steps=cfg.steps, interpret=smoke)
  out_bytes = 4 * cfg.n * (bk * cfg.s if cfg.output == "scores" else bk * cfg.splits)
  return _timed_row(cfg, fn, (codes, qd), bk=bk, extra_bytes={"qd_bytes": qd.size, "out_bytes": out_bytes},
                    iters=iters, sms=sms, mhz=mhz, smoke=smoke)


def time_value_config(cfg: ValueConfig, args_cache: dict, iters: int, sms: int, mhz: float, smoke: bool) -> dict:
  bk = 2 if smoke else BK
  p, vcodes = _cached_inputs(args_cache, ("value", bk, cfg.s, cfg.n), lambda: value_inputs(0, bk, cfg.s, cfg.n))
  fn = value_fn(plane_types=cfg.plane_types, block_s=cfg.block_s, splits=cfg.splits, a_operand=cfg.a_operand,
                steps=cfg.steps, interpret=smoke)
  out_bytes = 4 * bk * cfg.splits * cfg.plane_types * 4 * Q * cfg.n
  return _timed_row(cfg, fn, (p, vcodes), bk=bk, extra_bytes={"p_bytes": p.size, "out_bytes": out_bytes},
                    iters=iters, sms=sms, mhz=mhz, smoke=smoke)


def _check_line(c: dict, what: str, index: str = "") -> str:
  """A check's report line: ok, FAIL (compile or shape error) or MISMATCH with its first wrong element."""
  if "error" in c:
    return f"- FAIL {what}: {c['error']}"
  if c["ok"]:
    return f"- ok {what}"
  return (f"- MISMATCH {what}: {c['mismatches']}/{c['elements']} differ, first at {c['first_mismatch']} "
          f"{index}got {c['got']} want {c['want']}")


def write_report(out_dir: str, meta: dict, checks: list, rows: list, skipped: list, value_checks: list = (),
                 value_rows: list = ()) -> None:
  with open(os.path.join(out_dir, "oskvp_key_scores_mgpu.json"), "w") as fh:
    json.dump({**meta, "checks": checks, "rows": rows, "value_checks": list(value_checks),
               "value_rows": list(value_rows), "skipped": skipped}, fh, indent=1)
  md = [f"# Mosaic GPU OS-KVP key scores and value sums: {meta['device']}, jax {meta['jax']}, {meta['date']}", "",
        f"Mode: {meta['mode']}. `cycles/token-head` = µs · {meta['mhz']:.0f} MHz · {meta['sms']} SMs / (BK · S) "
        f"(SMs: {meta['sms_source']}; clock: {meta['mhz_source']}); the 0.108 ms target leaves "
        f"{TARGET_CYCLES} for the whole attention. `floor` = the code bytes at {HBM_TBPS} TB/s in the same unit. "
        f"CUPTI kernel time, median of {meta['iters']} calls, L2 flushed (except `L2-warm` rows: codes "
        "L2-resident, the compute side's cost).", "",
        "## Checks (exact int32 vs the jnp reference)", ""]
  for c in checks:
    md.append(_check_line(c, f"{c['kernel']} BK={c['bk']} S={c['s']} N={c['n']} T={c['plane_types']} "
                             f"bs={c['block_s']} splits={c['splits']} out={c['output']} ring={c['ring']} "
                             f"A={c['a_operand']}"))
  md += ["", f"## Timing (BK = {rows[0].get('bk', BK) if rows else BK}: batch × kv heads, Q = {Q} code bytes per "
         "token)", "",
         "| config | µs | code MB | TB/s (codes) | cycles/token-head | of the 6.7 budget | floor | compile s |",
         "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      md.append(f"| {r['config']} | error: {r['error'][:200]} | | | | | | |")
      continue
    md.append(f"| {r['config']} | {r['us']:.1f} | {r['code_bytes'] / 1e6:.1f} | {r['tbps_codes']:.2f} | "
              f"{r['cycles_per_token_head']:.2f} | {100 * r['share_of_target']:.0f}% | "
              f"{r['hbm_floor_cycles']:.2f} | {r['compile_s']:.1f} |")
  md += ["", "## Value side (`value_sums_mgpu`)", "", "Checks (exact int32 vs `value_sums_split_reference`):", ""]
  for c in value_checks:
    md.append(_check_line(c, f"value BK={c['bk']} S={c['s']} N={c['n']} T={c['plane_types']} bs={c['block_s']} "
                             f"splits={c['splits']} ring={c['ring']} A={c['a_operand']}",
                          index="[bk, split, type, channel, n] "))
  md += ["", f"Timing (V codes token-contiguous uint8 [BK, Q, S], Q = {Q}; `main` = the largest kernel alone, "
         "without the wrapper's output permutation):", "",
         "| config | µs | main µs | V-code MB | out MB | TB/s (codes) | cycles/token-head | main cycles | "
         "of the 6.7 budget | floor | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in value_rows:
    if "error" in r:
      md.append(f"| {r['config']} | error: {r['error'][:200]} | | | | | | | | | |")
      continue
    md.append(f"| {r['config']} | {r['us']:.1f} | {r['main_us']:.1f} | {r['code_bytes'] / 1e6:.1f} | "
              f"{r['out_bytes'] / 1e6:.1f} | {r['tbps_codes']:.2f} | {r['cycles_per_token_head']:.2f} | "
              f"{r['main_cycles_per_token_head']:.2f} | {100 * r['share_of_target']:.0f}% | "
              f"{r['hbm_floor_cycles']:.2f} | {r['compile_s']:.1f} |")
  if skipped:
    md += ["", "Skipped (time budget): " + "; ".join(skipped)]
  with open(os.path.join(out_dir, "oskvp_key_scores_mgpu.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")


def run_meta(smoke: bool, iters: int) -> dict:
  """The run's header for the JSON and Markdown reports: device, jax, date, mode, SM count and clock (and where they
  came from, `device_constants`)."""
  sms, mhz, sms_src, mhz_src = device_constants(smoke)
  return {"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform, "jax": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "mode": "smoke (CPU interpret, numbers meaningless)" if smoke else "gpu", "iters": iters,
          "sms": sms, "mhz": mhz, "sms_source": sms_src, "mhz_source": mhz_src}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/oskvp_key_scores_mgpu")
  ap.add_argument("--smoke", action="store_true", help="CPU interpret mode at tiny shapes; checks + report only")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--budget-s", type=float, default=290.0,
                  help="start no new timed config (key or value, SCHEDULE order) after this many seconds")
  ap.add_argument("--lower-only", action="store_true",
                  help="only lower every timed config for CUDA at its real shape (runs on the CPU) and exit")
  ap.add_argument("--match", default="",
                  help="comma-separated substrings: time only the SCHEDULE configs whose name contains one of them")
  ap.add_argument("--time-on-mismatch", action="store_true", help="time even if a check fails")
  ap.add_argument("--dump", type=int, default=-1,
                  help="compile and run DUMP_CONFIGS[I] once (run with MOSAIC_GPU_DUMP_TO=<dir>) and exit")
  ap.add_argument("--analyze-dump", default="", help="comma-separated dump folders: ptxas report and loop SASS")
  args = ap.parse_args(argv)
  if args.dump >= 0:
    return dump(args.dump)
  if args.analyze_dump:
    print(json.dumps({d: analyze_dump(d) for d in args.analyze_dump.split(",")}, indent=1))
    return 0
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  if args.lower_only:
    for cfg in SCHEDULE:
      lower_for_cuda(cfg)
      print("lowered", cfg.name, flush=True)
    return 0
  smoke = args.smoke
  meta = {**run_meta(smoke, args.iters), "formula": "cycles_per_token_head = us * mhz * sms / (bk * s)",
          "target_cycles": TARGET_CYCLES}
  checks, rows, skipped, vchecks, vrows = [], [], [], [], []
  report = lambda: write_report(args.out, meta, checks, rows, skipped, vchecks, vrows)
  print(json.dumps(meta), flush=True)
  for case in SMOKE_CHECKS if smoke else CHECKS:
    for a_operand in ks.A_OPERANDS:
      checks.append(run_check(case, a_operand, interpret=smoke))
      print("check", json.dumps(checks[-1]), flush=True)
      report()
  for case in SMOKE_VALUE_CHECKS if smoke else VALUE_CHECKS:
    for a_operand in vs.A_OPERANDS:
      vchecks.append(run_value_check(case, a_operand, interpret=smoke))
      print("value check", json.dumps(vchecks[-1]), flush=True)
      report()
  failed = [("key", c) for c in checks if not c["ok"]] + [("value", c) for c in vchecks if not c["ok"]]
  if failed:
    sides = {side: sorted({c["a_operand"] for s, c in failed if s == side}) for side, _ in failed}
    print(f"CHECK FAILED: {len(failed)} of {len(checks) + len(vchecks)} checks mismatch or fail to compile (see "
          f"{args.out}/oskvp_key_scores_mgpu.md); failing side: A routes {sides}", flush=True)
    if not args.time_on_mismatch:
      return 1
  configs = ([Config(256, splits=2), ValueConfig(256, splits=2, steps=2), Config(256, splits=1, output="scores")]
             if smoke else [c for c in SCHEDULE if not args.match or any(m in c.name for m in args.match.split(","))])
  cache: dict = {}
  for cfg in configs:
    if time.perf_counter() - start > args.budget_s:
      skipped.append(cfg.name)
      continue
    value = isinstance(cfg, ValueConfig)
    timer, out = (time_value_config, vrows) if value else (time_config, rows)
    try:
      out.append(timer(cfg, cache, 1 if smoke else args.iters, meta["sms"], meta["mhz"], smoke))
    except Exception as e:  # pylint: disable=broad-except
      out.append({"config": cfg.name, **dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:600]}"})
    print("value time" if value else "time", json.dumps(out[-1]), flush=True)
    report()
  report()
  with open(os.path.join(args.out, "oskvp_key_scores_mgpu.md")) as fh:
    print(fh.read())
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
