"""benchmarks/decode_attention_mosaic.py (the wired Mosaic path decode_attention.py times): its value layouts hold
the same cache either way."""

import jax
import numpy as np
import pytest

from benchmarks import decode_attention as da
from benchmarks import decode_attention_mosaic as mos


def test_uniform_args_hold_the_same_cache_in_both_value_layouts():
  """`uniform_args` block-major ([B, K, S/128, X, 128], the cache's) and tokens contiguous ([B, K, X, S]) are the
  same bytes: `token_major` gives identical arrays from both; every other argument is the same; rows are labelled
  apart, and an unknown layout is refused by name."""
  b, s = 2, 256
  blocks, tokens = (mos.uniform_args(jax.random.key(3), b, s, layout) for layout in ("blocks", "tokens"))
  assert blocks[5].shape == (b, da.KV_HEADS, s // 128, da.HEAD_DIM // 4, 128)
  assert blocks[6].shape == (b, da.KV_HEADS, s // 128, 8, 128)
  assert tokens[5].shape == (b, da.KV_HEADS, da.HEAD_DIM // 4, s)
  for x, y in zip(mos.token_major(blocks), mos.token_major(tokens)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  assert mos.token_major(blocks)[5].shape == (b, da.KV_HEADS, s, da.HEAD_DIM // 4)
  assert (mos.value_layout_label("blocks"), mos.value_layout_label("tokens")) == ("", "_vtokens")
  with pytest.raises(ValueError, match="value_layout='rows'"):
    mos.uniform_args(jax.random.key(3), b, s, "rows")


def test_options_and_their_row_labels():
  """The grid's options resolve as `uniform_decode_attention` takes them, and the row labels that results files carry
  stay as before: the defaults add nothing, every other option its own suffix; options the XLA glue or the rotating
  epilogue would refuse are skipped rather than timed."""
  assert mos.mosaic_core_parts("mma") == ("mma", "tokens") and mos.mosaic_core_parts("mma:heads") == ("mma", "heads")
  assert (mos.mosaic_core_label("wgmma"), mos.mosaic_core_label("mma")) == ("", "_mma_tokens")
  assert mos.rotation_label("xla", "xla") == ""
  assert mos.rotation_label("prologue", "epilogue") == "_qrot_prologue_orot_epilogue"
  assert (mos.channels_arg("auto"), mos.channels_arg("64")) == (None, 64)
  assert mos.rotation_applies("pallas", "prologue") and not mos.rotation_applies("xla", "prologue")
  assert mos.channels_apply("auto", "xla", "64") and not mos.channels_apply("xla", "xla", "64")
  assert not mos.channels_apply("auto", "epilogue", "64") and mos.channels_apply("xla", "xla", "auto")
