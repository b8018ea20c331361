"""The stream-layout probe's CPU path: both value layouts hold the same bytes, and every program of the ring runs in
Mosaic GPU's interpreter (its output row is its scale row, copied through shared memory)."""

import json
import os

import jax
import numpy as np

from benchmarks import oskvp_stream_layout_probe as probe
from benchmarks import report_files


def test_block_major_holds_the_strided_blocks_end_to_end():
  _, vc, _, vo, _ = probe.inputs(jax.random.key(0), 2, 512, "strided")
  _, vcb, _, vob, _ = probe.inputs(jax.random.key(0), 2, 512, "block_major")
  assert vcb.shape == (2, 4 * probe.Q, probe.BLOCK) and vob.shape == (2, 4 * probe.O, probe.BLOCK)
  for blk in range(4):  # block b's rows are the strided array's columns [128 b, 128 b + 128)
    cols = slice(blk * probe.BLOCK, (blk + 1) * probe.BLOCK)
    np.testing.assert_array_equal(vcb[:, blk * probe.Q:(blk + 1) * probe.Q], vc[:, :, cols])
    np.testing.assert_array_equal(vob[:, blk * probe.O:(blk + 1) * probe.O], vo[:, :, cols])


def test_smoke_runs_every_program_in_both_layouts(tmp_path):
  assert probe.main(["--smoke", f"--out={tmp_path}", "--rings=2"]) == 0
  with open(os.path.join(tmp_path, f"oskvp_stream_layout_{report_files.device_slug()}.json")) as fh:
    res = json.load(fh)
  assert [r["layout"] for r in res["rows"]] == list(probe.LAYOUTS)
  assert all(r["bytes"] == 2 * 1024 * 80 for r in res["rows"])
