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


CONTEXT_TOKENS = 8  # prompt tokens `decode_continuation` decodes before the new ones


def decode_continuation(tokenizer, context, new) -> str:
  """The text `new` ids add after `context` ids: decode(context[-8:] + new) less decode(context[-8:]).

  Decoding a completion on its own is wrong for tokenizers whose decoder treats the first token as the start of
  the text (Llama / Mixtral's Metaspace decoder strips the leading space: " world" came back as "world", and a stop
  string " world" was then never found), or whose first bytes finish a character begun in the prompt. The byte
  tokenizer's completions start on a character boundary after text prompts, so for it this equals `decode(new)`.
  """
  context = [int(i) for i in np.asarray(context).reshape(-1)][-CONTEXT_TOKENS:]
  new = [int(i) for i in np.asarray(new).reshape(-1)]
  head = tokenizer.decode(context) if context else ""
  full = tokenizer.decode(context + new)
  return full[len(head):] if full.startswith(head) else tokenizer.decode(new)


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
