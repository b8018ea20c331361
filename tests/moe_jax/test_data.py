"""The stdlib corpus: deterministic split by path hash, step-indexed batches, the unigram baseline."""

import os

import numpy as np
import pytest

from moe_jax import data, tokenizer


def test_split_is_a_function_of_the_relative_path():
  files = data.list_files()
  assert len(files) > 100
  val = [f for f in files if data.is_validation(f)]
  # ~5% of files, and the rule is reproducible call to call.
  assert 0.01 < len(val) / len(files) < 0.12
  assert val == [f for f in files if data.is_validation(f)]
  assert not any(part in data.EXCLUDED_DIRS for f in files for part in f.split(os.sep)[:-1])
  assert all(f.endswith(".py") for f in files)


def test_corpus_streams_and_sizes(tmp_path):
  # A fake stdlib: the split rule decides, test dirs and site-packages are skipped.
  names = [f"mod{i}.py" for i in range(40)]
  for n in names:
    (tmp_path / n).write_text(f"x = {n!r}\n")
  for skipped in ("test", "site-packages"):
    (tmp_path / skipped).mkdir()
    (tmp_path / skipped / "ignored.py").write_text("nope\n")
  corpus = data.load_corpus(str(tmp_path), val_permille=300)
  val_names = [n for n in names if data.is_validation(n, 300)]
  assert corpus["validation"].n_files == len(val_names)
  assert corpus["train"].n_files + corpus["validation"].n_files == len(names)
  total_bytes = sum(len((tmp_path / n).read_bytes()) for n in names)
  assert corpus["train"].n_bytes + corpus["validation"].n_bytes == total_bytes
  stream = corpus["validation"].tokens
  assert int(np.sum(stream == tokenizer.BOS_ID)) == len(val_names)
  assert tokenizer.decode(stream[1:]).startswith(f"x = {val_names[0]!r}")


def test_batches_depend_only_on_seed_and_step():
  tokens = np.random.default_rng(0).integers(0, 256, size=10_000).astype(np.uint16)
  a = data.train_batch(tokens, 7, batch_size=4, seq_len=32, seed=1)
  b = data.train_batch(tokens, 7, batch_size=4, seq_len=32, seed=1)
  c = data.train_batch(tokens, 8, batch_size=4, seq_len=32, seed=1)
  assert a.shape == (4, 33) and a.dtype == np.int32
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  # Every row is a contiguous window of the stream.
  start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 33) == a[0], axis=1))[0])
  np.testing.assert_array_equal(tokens[start:start + 33], a[0])


def test_batches_reach_the_last_window_and_a_stream_of_one_window():
  """Every start whose window fits is drawn, the last included (before: the upper bound excluded it, and a stream of
  exactly seq_len + 1 tokens raised numpy's 'high <= 0')."""
  tokens = np.arange(36, dtype=np.uint16)  # seq_len 32: starts 0..3
  starts = {int(data.train_batch(tokens, s, batch_size=8, seq_len=32)[i, 0]) for s in range(20) for i in range(8)}
  assert starts == {0, 1, 2, 3}
  np.testing.assert_array_equal(data.train_batch(tokens[:33], 0, batch_size=2, seq_len=32), np.stack([tokens[:33]] * 2))
  with pytest.raises(ValueError, match="seq_len=32: a window needs seq_len \\+ 1 tokens, the stream has 32"):
    data.train_batch(tokens[:32], 0, batch_size=2, seq_len=32)


def test_eval_windows_are_evenly_spaced_and_bounded():
  tokens = np.arange(1000, dtype=np.uint16)
  w = data.eval_windows(tokens, n_windows=5, seq_len=99)
  assert w.shape == (5, 100)
  assert w[0, 0] == 0 and w[-1, -1] == 999
  with pytest.raises(ValueError, match="seq_len"):
    data.eval_windows(tokens, n_windows=2, seq_len=5000)


def test_unigram_baseline():
  rng = np.random.default_rng(1)
  uniform = rng.integers(0, 256, size=200_000)
  # Uniform bytes cost ~8 bits; a skewed source costs less, and the real corpus sits in between.
  assert abs(data.unigram_bits_per_byte(uniform, uniform) - 8.0) < 0.05
  skewed = rng.choice(4, size=200_000, p=[0.7, 0.1, 0.1, 0.1])
  assert abs(data.unigram_bits_per_byte(skewed, skewed) - 1.357) < 0.02
  corpus = data.load_corpus()
  bpb = data.unigram_bits_per_byte(corpus["train"].tokens, corpus["validation"].tokens)
  assert 4.0 < bpb < 5.5
