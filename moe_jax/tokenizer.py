"""Byte-level tokenizer of the built-in configs: token = byte value, plus three special tokens."""

from __future__ import annotations

import numpy as np

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
VOCAB_SIZE = 264  # 256 bytes + PAD/BOS/EOS, padded to a multiple of 8.


def encode(text: str, *, bos: bool = True) -> list[int]:
  ids = list(text.encode("utf-8"))
  return [BOS_ID] + ids if bos else ids


def decode(ids) -> str:
  data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
  return data.decode("utf-8", errors="replace")


class ByteTokenizer:
  """The interface `generate` uses; `moe_jax.hf` supplies the same for `tokenizer.json`."""

  bos_id = BOS_ID
  eos_id = EOS_ID
  pad_id = PAD_ID
  vocab_size = VOCAB_SIZE

  def encode(self, text: str) -> list[int]:
    return encode(text)

  def decode(self, ids) -> str:
    return decode(ids)
