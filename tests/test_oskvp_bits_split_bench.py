"""benchmarks/oskvp_bits_split.py on one window of tiny-trained: its 2-bit pass reads what the real `oskvp` cache's
decode path reads (bits per byte within 0.3% of `moe_jax.eval`'s teacher-forced decode), and the report files."""

import json
import os

import jax.numpy as jnp
import numpy as np

from benchmarks import oskvp_bits_split as bench
from moe_jax import cli
from moe_jax import data as data_lib
from moe_jax import eval as eval_lib


def test_the_simulation_matches_the_real_cache_on_one_window():
  config, model = cli.load_checkpoint("tiny-trained")
  windows = data_lib.eval_windows(data_lib.load_corpus()["validation"].tokens, n_windows=1, seq_len=bench.CONTEXT)
  (row,) = bench.run(model, config, windows, pairs=(("2-bit", "2-bit"),))
  logp, _ = eval_lib.teacher_forced_logprobs(model, jnp.asarray(windows), prefix=bench.PREFIX, kv_cache="oskvp",
                                             cache_len=bench.CONTEXT + 1)
  real = eval_lib.bits_per_byte(np.asarray(logp), windows[:, bench.PREFIX:])
  # The real cache keeps its window in bf16 and the simulation in float32: close, not equal.
  assert abs(row["bpb"] / real - 1) < 3e-3, (row["bpb"], real)
  assert row["bpb"] > row["exact_bpb"]  # compression costs bits


def test_one_window_writes_the_report(tmp_path):
  assert bench.main(["--windows=1", "--pairs=exact/exact;2-bit/2-bit, block codebooks", f"--out={tmp_path}"]) == 0
  with open(os.path.join(tmp_path, "oskvp_bits_split_cpu.json"), encoding="utf-8") as f:
    rows = json.load(f)["rows"]
  assert [(r["keys"], r["values"]) for r in rows] == [("exact", "exact"), ("2-bit", "2-bit, block codebooks")]
  assert rows[0]["rel"] == 0 and rows[1]["rel"] != 0
  assert "| 2-bit | 2-bit, block codebooks |" in open(os.path.join(tmp_path, "oskvp_bits_split_cpu.md"),
                                                       encoding="utf-8").read()
