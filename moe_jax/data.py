"""Training data: the `.py` sources of the running interpreter's standard library, as byte-level tokens.

The corpus exists offline on every machine with Python. Which files:
  * every `*.py` under `sysconfig.get_paths()["stdlib"]`,
  * except anything under `site-packages/` (installed third-party code, differs per machine), `__pycache__/`,
    and the stdlib's own test suites (directories named `test`, `tests` or `idle_test`: large generated data
    files that dominate the byte count and are unlike ordinary code).

Split: by file, deterministically, on a hash of the path relative to the stdlib root (`sha256(relpath)`): a file is
in validation when the hash's first 8 hex digits, as an integer, mod 1000 is below `val_permille` (default 50, ~5%).
The split depends only on the relative path, so two machines with the same stdlib agree; a different Python patch
version may hold slightly different files, which is why the recorded validation numbers are computed on the machine
that evaluates.

Tokens: each file is `BOS` followed by its bytes (`moe_jax.tokenizer`), files concatenated in sorted path order into
one stream per split. Training windows are drawn at offsets that depend only on (seed, step), so a batch is a pure
function of the step: resuming at step s reproduces the batches exactly, and the loader's whole state is the step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig

import numpy as np

from moe_jax import tokenizer

EXCLUDED_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test")


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def is_validation(relpath: str, val_permille: int = 50) -> bool:
  """The split rule: a hash of the relative path, so it is deterministic and independent of file order."""
  digest = hashlib.sha256(relpath.replace(os.sep, "/").encode("utf-8")).hexdigest()
  return int(digest[:8], 16) % 1000 < val_permille


def list_files(root: str | None = None) -> list[str]:
  """Relative paths (sorted) of the corpus files under `root` (default: this interpreter's stdlib)."""
  root = root or stdlib_root()
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    for f in filenames:
      if f.endswith(".py"):
        out.append(os.path.relpath(os.path.join(dirpath, f), root))
  return sorted(out)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """One split as a token stream.

  Attributes:
    tokens: uint16 [L], BOS + bytes of each file, concatenated.
    n_files: files in the split.
    n_bytes: source bytes in the split (tokens minus one BOS per file).
  """

  tokens: np.ndarray
  n_files: int
  n_bytes: int


@functools.lru_cache(maxsize=4)
def load_corpus(root: str | None = None, val_permille: int = 50) -> dict[str, Corpus]:
  """Reads the corpus once per process: {"train": Corpus, "validation": Corpus}."""
  root = root or stdlib_root()
  parts = {"train": [], "validation": []}
  for rel in list_files(root):
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read()
    split = "validation" if is_validation(rel, val_permille) else "train"
    parts[split].append(np.concatenate([np.array([tokenizer.BOS_ID], np.uint16),
                                        np.frombuffer(data, np.uint8).astype(np.uint16)]))
  out = {}
  for split, arrays in parts.items():
    if not arrays:
      raise ValueError(f"split {split!r} of {root} is empty (val_permille={val_permille})")
    tokens = np.concatenate(arrays)
    out[split] = Corpus(tokens=tokens, n_files=len(arrays), n_bytes=int(tokens.size - len(arrays)))
  return out


def describe(corpus: dict[str, Corpus]) -> str:
  return ", ".join(f"{s}: {c.n_files} files, {c.n_bytes:,} bytes" for s, c in corpus.items())


def train_batch(tokens: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int = 0) -> np.ndarray:
  """The training batch of `step`: int32 [B, seq_len + 1] windows at offsets drawn from (seed, step) alone.

  Inputs are `batch[:, :-1]`, targets `batch[:, 1:]`.
  """
  if tokens.size < seq_len + 1:
    raise ValueError(f"seq_len={seq_len}: a window needs seq_len + 1 tokens, the stream has {tokens.size}")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, tokens.size - seq_len, size=batch_size)  # every start whose window fits: 0..size - L - 1
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  return tokens[idx].astype(np.int32)


def eval_windows(tokens: np.ndarray, *, n_windows: int, seq_len: int) -> np.ndarray:
  """`n_windows` validation windows, int32 [n_windows, seq_len + 1], evenly spaced over the stream (deterministic)."""
  if tokens.size < seq_len + 2:
    raise ValueError(f"seq_len={seq_len} is longer than the split ({tokens.size} tokens)")
  starts = np.linspace(0, tokens.size - seq_len - 1, n_windows).astype(np.int64)
  return tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)


def unigram_bits_per_byte(train: np.ndarray, validation: np.ndarray, vocab_size: int = tokenizer.VOCAB_SIZE) -> float:
  """Cross-entropy (bits per predicted token) on `validation` of the add-one-smoothed unigram model of `train`.

  The baseline a trained model must beat: it knows the byte frequencies and nothing about context. Counted over the
  same targets as the model's bits per byte (every token after the first; BOS targets included).
  """
  counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
  logp = np.log2(counts / counts.sum())
  return float(-np.mean(logp[validation[1:]]))


def main(argv):
  del argv
  corpus = load_corpus()
  print(f"stdlib corpus at {stdlib_root()}: {describe(corpus)}")
  print(f"unigram baseline (train -> validation): "
        f"{unigram_bits_per_byte(corpus['train'].tokens, corpus['validation'].tokens):.4f} bits/byte")


if __name__ == "__main__":
  from absl import app
  app.run(main)
