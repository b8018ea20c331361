"""benchmarks/oskvp_key_bits3_decode.py's report (the timings themselves run on the GPU): byte counts and the ratio
columns."""

from benchmarks import oskvp_key_bits3_decode as bench
from benchmarks.decode_attention import HEAD_DIM, KV_HEADS, oskvp_bytes


def test_third_bits_add_an_eighth_of_a_byte_per_channel():
  b, s = 2, 4096
  assert bench.k3_bytes(b, s) - oskvp_bytes(b, s) == b * KV_HEADS * (s * HEAD_DIM // 8 + HEAD_DIM * 16)


def test_the_table_gives_each_row_its_ratios_at_its_own_shape():
  row = lambda impl, b, ms: dict(impl=impl, batch=b, context=65536, ms=ms, bytes_read=10**8, tb_per_s=1.0,
                                 frac_copy_bw=0.25)
  rows = [row("oskvp_k3_pallas", 8, 0.8), row("oskvp_k2_pallas", 8, 0.4), row("cudnn_bf16", 8, 0.6),
          row("oskvp_k3_pallas", 1, 0.2)]
  md = bench.render_md("test device", 4.0, [dict(g=4, rel_err=1e-3, nan=False)], rows)
  k3_b8 = next(line for line in md if line.startswith("| oskvp_k3_pallas | 8 |"))
  assert k3_b8.endswith("| 0.75x | 0.50x |")  # cuDNN 0.6 / 0.8, 2-bit 0.4 / 0.8
  assert next(line for line in md if line.startswith("| oskvp_k3_pallas | 1 |")).endswith("| - | - |")
  assert any("G=4 rel err 1.0e-03" in line for line in md)
