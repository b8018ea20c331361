"""benchmarks/decode_attention.py's value layouts of the wired Mosaic path: the same cache either way."""

import jax
import numpy as np
import pytest

from benchmarks import decode_attention as da


def test_uniform_args_hold_the_same_cache_in_both_value_layouts():
  """`uniform_args` block-major ([B, K, S/128, X, 128], the cache's) and tokens contiguous ([B, K, X, S]) are the
  same bytes: `token_major` gives identical arrays from both; every other argument is the same; rows are labelled
  apart, and an unknown layout is refused by name."""
  b, s = 2, 256
  blocks, tokens = (da.uniform_args(jax.random.key(3), b, s, layout) for layout in ("blocks", "tokens"))
  assert blocks[5].shape == (b, da.KV_HEADS, s // 128, da.HEAD_DIM // 4, 128)
  assert blocks[6].shape == (b, da.KV_HEADS, s // 128, 8, 128)
  assert tokens[5].shape == (b, da.KV_HEADS, da.HEAD_DIM // 4, s)
  for x, y in zip(da.token_major(blocks), da.token_major(tokens)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  assert da.token_major(blocks)[5].shape == (b, da.KV_HEADS, s, da.HEAD_DIM // 4)
  assert (da.value_layout_label("blocks"), da.value_layout_label("tokens")) == ("", "_vtokens")
  with pytest.raises(ValueError, match="value_layout='rows'"):
    da.uniform_args(jax.random.key(3), b, s, "rows")
