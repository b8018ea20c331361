"""The decode-attention benchmark's merge of several GPU runs into one result file (no GPU needed)."""

import pytest

from benchmarks import decode_attention as bench


def _run(date, cells):
  """A run's result with rows for each (context, batch) -> (cudnn ms, kernel ms)."""
  meta = dict(device="H200", jax="0.11.2", date=date, copy_tb_per_s=3.7, read_tb_per_s=3.6,
              shapes=dict(n_heads=32, kv_heads=8, window=128), best_configs={})
  rows = []
  for (s, b), (cudnn_ms, ours_ms) in cells.items():
    for impl, ms in (("cudnn_bf16", cudnn_ms), ("oskvp_pallas_bitplane", ours_ms)):
      rows.append(dict(impl=impl, batch=b, context=s, ms=ms, bytes_read=10**6, tb_per_s=1e6 / ms / 1e9,
                       frac_copy_bw=0.1, note=""))
  return dict(meta=meta, checks=[dict(case=0, config="c", rel_err=1e-3, nan=False)], sweep=[], rows=rows)


def test_cells_come_whole_from_the_last_run_and_ratios_stay_within_a_run():
  old = _run("2026-11-30T17:30", {(4096, 1): (1.0, 2.0), (65536, 8): (4.0, 3.0)})
  new = _run("2026-11-30T18:30", {(65536, 8): (5.0, 2.5), (131072, 8): (8.0, 6.0)})
  merged = bench.merge_runs([old, new], ["run10", "run11"])
  got = {(r["context"], r["batch"], r["impl"]): (r["ms"], r["run"]) for r in merged["rows"]}
  assert len(merged["rows"]) == 6
  assert got[(4096, 1, "cudnn_bf16")] == (1.0, "run10")
  assert got[(65536, 8, "cudnn_bf16")] == (5.0, "run11")  # the later run replaces the whole cell
  assert got[(65536, 8, "oskvp_pallas_bitplane")] == (2.5, "run11")
  assert [m["run"] for m in merged["meta"]["runs"]] == ["run10", "run11"]
  assert [c["run"] for c in merged["checks"]] == ["run10", "run11"]
  md = bench.render_md(merged, sources=["a/decode_attention_run10.json", "b/decode_attention_run11.json"])
  # vs cuDNN against the cell's own run: 5.0 / 2.5 (not the older run's 4.0 / 2.5).
  assert "| oskvp_pallas_bitplane | 8 | 65536 | 2.5000 | 1.0 MB | 0.00 | 10% | 2.00x | run11 |" in md
  assert "| oskvp_pallas_bitplane | 1 | 4096 | 2.0000 | 1.0 MB | 0.00 | 10% | 0.50x | run10 |" in md


def test_a_single_run_renders_without_a_run_column():
  md = bench.render_md(_run("2026-11-30T17:30", {(4096, 1): (1.0, 2.0)}))
  assert "| impl | batch | context | ms | bytes read | TB/s | of copy BW | vs cuDNN |\n" in md
  assert "| oskvp_pallas_bitplane | 1 | 4096 | 2.0000 | 1.0 MB | 0.00 | 10% | 0.50x |\n" in md


def test_an_added_run_adds_its_new_implementations_and_compares_them_with_its_own_cudnn_row():
  base = _run("2026-11-30T17:30", {(65536, 8): (4.0, 3.0)})
  later = _run("2026-12-01T07:30", {(65536, 8): (5.0, 3.5), (131072, 8): (8.0, 6.0)})
  for r in later["rows"]:
    r["span_ms"] = 0.96 * r["ms"]
  later["rows"].append(dict(impl="oskvp_mosaic_uniform", batch=8, context=65536, ms=2.0, span_ms=1.6,
                            bytes_read=10**6, tb_per_s=0.5, frac_copy_bw=0.2, note=""))
  merged = bench.merge_runs([base, later], ["run10", "span"], (False, True))
  got = sorted((r["context"], r["impl"], r["run"]) for r in merged["rows"])
  # The base cell stays whole; the added run brings its new implementation and its own cuDNN rows, not its
  # bit-plane rows (an implementation the base runs already have).
  assert got == [(65536, "cudnn_bf16", "run10"), (65536, "cudnn_bf16", "span"), (65536, "oskvp_mosaic_uniform", "span"),
                 (65536, "oskvp_pallas_bitplane", "run10"), (131072, "cudnn_bf16", "span")]
  md = bench.render_md(merged)
  # Wall 5.0 / 2.0 and span 4.8 / 1.6 against the added run's cuDNN row, not run10's 4.0.
  assert "| oskvp_mosaic_uniform | 8 | 65536 | 2.0000 | 1.0 MB | 0.50 | 20% | 2.50x | 1.6000 | 3.00x | span |" in md
  assert "| oskvp_pallas_bitplane | 8 | 65536 | 3.0000 | 1.0 MB | 0.00 | 10% | 1.33x | - | - | run10 |" in md


def test_a_later_added_run_replaces_an_earlier_added_runs_rows_in_the_cells_it_times():
  base = _run("2026-11-30T17:30", {(65536, 8): (4.0, 3.0)})
  first = _run("2026-12-01T07:30", {(65536, 8): (5.0, 3.5), (4096, 8): (1.0, 2.0)})
  second = _run("2026-12-01T10:00", {(65536, 8): (4.5, 3.5)})
  for run, ms in ((first, 2.0), (second, 1.5)):
    run["rows"] += [dict(impl="oskvp_mosaic_uniform", batch=8, context=c, ms=ms, bytes_read=10**6, tb_per_s=0.5,
                         frac_copy_bw=0.2, note="") for c in {r["context"] for r in run["rows"]}]
  merged = bench.merge_runs([base, first, second], ["run10", "first", "second"], (False, True, True))
  got = sorted((r["context"], r["impl"], r["run"]) for r in merged["rows"])
  # 64k: the second added run's row and cuDNN row replace the first's; 4k: the first added run's stay.
  assert got == [(4096, "cudnn_bf16", "first"), (4096, "oskvp_mosaic_uniform", "first"),
                 (65536, "cudnn_bf16", "run10"), (65536, "cudnn_bf16", "second"),
                 (65536, "oskvp_mosaic_uniform", "second"), (65536, "oskvp_pallas_bitplane", "run10")]
  md = bench.render_md(merged)
  assert "| oskvp_mosaic_uniform | 8 | 65536 | 1.5000 | 1.0 MB | 0.50 | 20% | 3.00x | second |" in md


def test_span_rows_get_their_fraction_of_the_copy_timed_by_span():
  """Each clock over its own copy: the wall-clock rate over the wall-clock copy, the GPU span's rate over the copy
  timed by span; the table shows both and the header both copy figures."""
  rows = [bench.timing_row("cudnn_bf16", 32, 131072, 4.0, 16e9, copy_tbs=3.8, span_ms=3.6, copy_span_tbs=4.2),
          bench.timing_row("oskvp_mosaic_uniform", 32, 131072, 1.2, 2.4e9, copy_tbs=3.8, span_ms=1.0,
                           copy_span_tbs=4.2)]
  assert rows[1]["frac_copy_bw"] == pytest.approx(2.0 / 3.8)  # 2.4 GB in 1.2 ms
  assert rows[1]["frac_copy_bw_span"] == pytest.approx(2.4 / 4.2)  # in 1.0 ms of span
  # No span copy (CPU, or a run before it existed): no span fraction, and no column.
  assert "frac_copy_bw_span" not in bench.timing_row("x", 1, 1, 1.0, 1e6, copy_tbs=3.8, span_ms=0.5)
  run = _run("2026-12-02T17:30", {})
  run["rows"] = rows
  run["meta"].update(copy_span_tb_per_s=4.2, read_span_tb_per_s=4.4)
  md = bench.render_md(run)
  assert "by GPU span (the clock of the span rows) copy 4.20 TB/s, read-only 4.40 TB/s" in md
  assert "| impl | batch | context | ms | bytes read | TB/s | of copy BW | vs cuDNN | GPU span ms | span vs cuDNN | " \
         "span of copy |\n" in md
  want = "| oskvp_mosaic_uniform | 32 | 131072 | 1.2000 | 2400.0 MB | 2.00 | 53% | 3.33x | 1.0000 | 3.60x | 57% |\n"
  assert want in md


def test_rel_l2_is_inf_for_a_nan_output():
  """The checks' relative L2 error: exact for finite outputs, inf (a failure under any limit) where the output has a
  NaN, so a broken kernel cannot pass a `rel <= limit` check."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  want = jnp.array([[3.0, 4.0]], jnp.bfloat16)
  assert bench.rel_l2(want, want) == 0.0
  assert abs(bench.rel_l2(jnp.array([[3.0, 4.5]]), want) - 0.1) < 1e-6
  assert bench.rel_l2(jnp.array([[3.0, float("nan")]]), want) == float("inf")
