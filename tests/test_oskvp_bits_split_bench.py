"""benchmarks/oskvp_bits_split.py on one window of tiny-trained: its 2-bit pass reads what the real `oskvp` cache's
decode path reads (bits per byte within 0.3% of `moe_jax.eval`'s teacher-forced decode), and the report files."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import oskvp_bits_split as bench
from moe_jax import cli
from moe_jax import data as data_lib
from moe_jax import eval as eval_lib
from moe_jax.kv_quant import kivi


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


def test_kivi2_storage_is_the_kivi_cache_format():
  """The "kivi2" side reads back what `kivi`'s quantizers store: keys per channel over 32-token groups, values per
  token over 32-channel groups; a token's key error depends on its group's range, not on other groups."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 64, 2, 64)).astype(np.float32))  # [B, T, K, H]
  keys = bench._stored(x, "kivi2", None, rope_span=65)  # pylint: disable=protected-access
  values = bench._stored(x, "kivi2", None, rope_span=0)  # pylint: disable=protected-access
  xt = jnp.swapaxes(x, 1, 2)
  np.testing.assert_allclose(jnp.swapaxes(keys, 1, 2), kivi.dequantize_keys(*kivi.quantize_keys(xt)), atol=1e-6)
  np.testing.assert_allclose(jnp.swapaxes(values, 1, 2), kivi.dequantize_values(*kivi.quantize_values(xt)),
                             atol=1e-6)
  assert 0.05 < float(jnp.abs(keys - x).max()) < 1.5 and not np.allclose(keys, values)  # half a step: range / 6
  big = x.at[:, 40].multiply(50.0)  # one token in the second group grows: the first group's keys keep their codes
  grown = bench._stored(big, "kivi2", None, rope_span=65)  # pylint: disable=protected-access
  np.testing.assert_allclose(grown[:, :32], keys[:, :32], atol=1e-6)


def test_rotated_kivi2_is_kivi_in_the_prefill_basis():
  """"rotated kivi2": KIVI's storage of x U (U the prefill's fit), rotated back; U orthogonal, so it is not KIVI's."""
  from moe_jax.kv_quant.oskvp_modes import OSKVPMode  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  x = jnp.asarray((rng.standard_normal((1, 288, 2, 64)) * np.linspace(0.2, 3.0, 64)).astype(np.float32))
  mode = OSKVPMode(window=128, rope_theta=None)
  got = bench._stored(x, "rotated kivi2", mode, rope_span=0)  # pylint: disable=protected-access
  u = mode.fit(x[:, :bench.PREFIX], jnp.full((1,), bench.PREFIX, jnp.int32), rope_span=0, bits=2).u  # [1, K, H, H]
  xr = jnp.einsum("BKTH,BKHJ->BKTJ", jnp.swapaxes(x, 1, 2), u)
  want = jnp.einsum("BKTJ,BKHJ->BKTH", kivi.dequantize_values(*kivi.quantize_values(xr)), u)
  np.testing.assert_allclose(jnp.swapaxes(got, 1, 2), want, atol=1e-4)
  plain = bench._stored(x, "kivi2", None, rope_span=0)  # pylint: disable=protected-access
  assert not np.allclose(got, plain, atol=1e-3)


def test_kivi2_with_other_groups():
  """"kivi2, groups of N": keys share a range over N tokens, values over N channels; N = 32 is "kivi2", and a
  group size that does not divide the tokens or channels is refused by name."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((1, 256, 2, 64)).astype(np.float32))  # [B, T, K, H]
  stored = lambda how, span: bench._stored(x, how, None, rope_span=span)  # pylint: disable=protected-access
  np.testing.assert_array_equal(stored("kivi2, groups of 32", 257), stored("kivi2", 257))
  keys = stored("kivi2, groups of 128", 257)
  xt = jnp.swapaxes(x, 1, 2)
  scale = kivi.quantize_keys(xt, 128)[1]
  assert scale.shape == (1, 2, 2, 64)  # two groups of 128 tokens
  np.testing.assert_allclose(jnp.swapaxes(keys, 1, 2), kivi.dequantize_keys(*kivi.quantize_keys(xt, 128)), atol=1e-6)
  values = stored("kivi2, groups of 64", 0)
  assert kivi.quantize_values(xt, 64)[1].shape == (1, 2, 256, 1)  # one range per token
  np.testing.assert_allclose(jnp.swapaxes(values, 1, 2), kivi.dequantize_values(*kivi.quantize_values(xt, 64)),
                             atol=1e-6)
  # Coarser groups span wider ranges: a larger error, on average, for the same 2 bits.
  err = lambda y: float(jnp.mean((y - x) ** 2))
  assert err(keys) > 1.2 * err(stored("kivi2", 257)) and err(values) > err(stored("kivi2", 0))
  with pytest.raises(ValueError, match="group=96"):
    kivi.quantize_keys(xt, 96)
  with pytest.raises(ValueError, match="group=48"):
    kivi.quantize_values(xt, 48)


def test_group_scales_follow_each_groups_range():
  """"2-bit, group scales" / "group rms scales": OS-KVP's levels stretched per 32-token group and channel (keys) or
  per token (values). On tokens whose spread changes from group to group, each codes the groups better relative to
  their spread, on average, than the prefill's levels alone (the rms form also in absolute error), and a token's key
  depends on its own group only."""
  from moe_jax.kv_quant.oskvp_modes import OSKVPMode  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(4)
  spread = np.repeat(rng.uniform(0.2, 3.0, (10, 1, 1, 1)), 32, axis=0) * np.linspace(0.5, 2.0, 64)  # [T, 1, 1, H]
  x = jnp.asarray((rng.standard_normal((320, 1, 2, 64)) * spread).transpose(1, 0, 2, 3).astype(np.float32))
  mode = OSKVPMode(window=128, rope_theta=None)
  stored = lambda xs, how, span: bench._stored(xs, how, mode, rope_span=span)  # pylint: disable=protected-access
  err = lambda y: float(jnp.mean((y - x) ** 2))
  per_group = lambda y: float(np.mean([jnp.mean((y - x)[:, g:g + 32] ** 2) / jnp.mean(x[:, g:g + 32] ** 2)
                                       for g in range(0, 320, 32)]))
  for span in (321, 0):  # keys (span > 0), then values
    plain = stored(x, "2-bit", span)
    for how in ("2-bit, group scales", "2-bit, group rms scales"):
      assert per_group(stored(x, how, span)) < 0.85 * per_group(plain), (how, span)
    assert err(stored(x, "2-bit, group rms scales", span)) < 0.9 * err(plain), span
  keys = stored(x, "2-bit, group scales", 321)
  grown = x.at[:, 300].multiply(20.0)  # a token of the last group: the earlier groups keep their keys
  np.testing.assert_allclose(stored(grown, "2-bit, group scales", 321)[:, :288], keys[:, :288], atol=1e-5)
