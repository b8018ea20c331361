"""Text generation: an on-device decode loop (`lax.while_loop`), a Python streaming variant, and the CLI.

    python -m moe_jax.generate --config=tiny --prompt="def f(x):" --max_new_tokens=32 [--batch=N] [--seed=S]
    python -m moe_jax.generate --checkpoint=tiny-trained --prompt="..."   # or a quant.convert / train --workdir dir
    python -m moe_jax.generate --hf=DIR --prompt="..."

prints the continuation and one report line: prefill ms, decode ms/token, tokens/s, KV cache bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import decode
from moe_jax.flat_model import FlatModel, module
from moe_jax.kv_cache import KVCache
from moe_jax.sampling import SamplingParams, sample
from moe_jax.tokenizer import PAD_ID, decode_continuation


@dataclasses.dataclass
class GenerateOutput:
  """tokens: int32 [B, max_new_tokens] (PAD after a sequence stops); lengths: int32 [B] tokens generated (EOS
  included); cache: the final KVCache."""

  tokens: jax.Array
  lengths: jax.Array
  cache: KVCache


def last_logits(logits: jax.Array, lengths: jax.Array) -> jax.Array:
  """[B, T, V] prefill logits -> [B, V] at each sequence's last prompt token."""
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "eos_id", "pad_id"))
def decode_loop(model, cache: KVCache, first_logits: jax.Array, key: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array, *, max_new_tokens: int, eos_id: int | None,
                pad_id: int = PAD_ID):
  """Samples up to `max_new_tokens` tokens per sequence on device.

  Args:
    model: the Transformer.
    cache: KVCache after prefill.
    first_logits: float32 [B, V], logits for the first new token.
    key: PRNG key.
    temperature, top_k, top_p: per-row sampling parameters [B].
    max_new_tokens: static loop bound.
    eos_id: a sequence stops after emitting it (None: only max_new_tokens stops).

  Returns:
    (tokens int32 [B, max_new_tokens], lengths int32 [B], cache).
  """
  b = first_logits.shape[0]
  key, sub = jax.random.split(key)
  tok = sample(first_logits, sub, temperature, top_k, top_p)
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(tok)
  done = jnp.zeros((b,), bool) if eos_id is None else tok == eos_id
  n = jnp.ones((b,), jnp.int32)

  def cond(state):
    i, _, _, done, _, _, _ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  model = module(model)  # a FlatModel's module (`FlatModel.of(model)` is a valid argument)

  def body(state):
    i, cache, tok, done, out, n, key = state
    logits, cache = model.decode(cache, tok[:, None])
    key, sub = jax.random.split(key)
    nxt = sample(logits[:, 0], sub, temperature, top_k, top_p)
    feed = jnp.where(done, 0, nxt)  # a finished row is fed token 0, not pad_id (maybe outside the vocabulary: NaN)
    nxt = jnp.where(done, pad_id, nxt)
    out = out.at[:, i].set(nxt)
    n = n + (~done).astype(jnp.int32)
    if eos_id is not None:
      done = done | (nxt == eos_id)
    return i + 1, cache, feed, done, out, n, key

  _, cache, _, _, out, n, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, tok, done, out, n, key))
  return out, n, cache


def _checked_max_new_tokens(max_new_tokens) -> int:
  if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
  return int(max_new_tokens)


def _cache_len(tokens: np.ndarray, max_new_tokens: int, cache_len: int | None) -> int:
  """cache_len, by default the prompts' positions + max_new_tokens - 1 (the last new token is not fed back)."""
  if cache_len is not None:
    return cache_len
  decode.check_prompt_shape(tokens)
  return int(tokens.shape[1]) + max_new_tokens - 1


def generate(model, tokens, lengths, *, key: jax.Array, max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), eos_id: int | None = None, kv_cache: str = "bf16",
             cache_len: int | None = None) -> GenerateOutput:
  """Prefill, then the on-device decode loop.

  Args:
    model: the Transformer.
    tokens: int [B, T] right-padded prompts; lengths: int [B].
    key: PRNG key (explicit randomness; greedy ignores it).
    max_new_tokens: tokens to generate per sequence (>= 1).
    sampling: greedy by default.
    eos_id: stop token.
    kv_cache: cache mode name.
    cache_len: cache positions; default prompt length + max_new_tokens - 1 (the last new token is not fed back).
  """
  max_new_tokens = _checked_max_new_tokens(max_new_tokens)
  if eos_id is not None and not (isinstance(eos_id, (int, np.integer)) and 0 <= eos_id < model.config.vocab_size):
    raise ValueError(f"eos_id={eos_id!r} must be None or a token id in [0, vocab_size={model.config.vocab_size})")
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  cache_len = _cache_len(tokens, max_new_tokens, cache_len)
  decode.validate_prompts(model.config, tokens, lengths, cache_len=cache_len, max_new_tokens=max_new_tokens)
  logits, cache = decode.prefill(model, tokens, lengths, kv_cache=kv_cache, cache_len=cache_len, last_only=True)
  out, n, cache = decode_loop(model, cache, logits, key,
                              *sampling.arrays(tokens.shape[0]), max_new_tokens=max_new_tokens, eos_id=eos_id)
  return GenerateOutput(tokens=out, lengths=n, cache=cache)


def stream(model, tokens, lengths, *, key: jax.Array, max_new_tokens: int,
           sampling: SamplingParams = SamplingParams(), kv_cache: str = "bf16",
           cache_len: int | None = None) -> Iterator[np.ndarray]:
  """Python-driven decode for debugging: yields the int32 [B] tokens of each step as they are produced."""
  max_new_tokens = _checked_max_new_tokens(max_new_tokens)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  cache_len = _cache_len(tokens, max_new_tokens, cache_len)
  decode.validate_prompts(model.config, tokens, lengths, cache_len=cache_len, max_new_tokens=max_new_tokens)
  model = FlatModel.of(model)  # one walk of the parameters, not one per step
  step_logits, cache = decode.prefill(model, tokens, lengths, kv_cache=kv_cache, cache_len=cache_len, last_only=True)
  params = sampling.arrays(tokens.shape[0])
  sample_jit = jax.jit(sample)
  for i in range(max_new_tokens):
    key, sub = jax.random.split(key)
    tok = sample_jit(step_logits, sub, *params)
    yield np.asarray(tok)
    if i + 1 < max_new_tokens:  # the last token is not fed back (the cache has no position for it)
      step_logits, cache = decode.decode_step(model, cache, tok, donate=True)  # the old cache is dropped


def pad_batch(prompts: list[list[int]], pad_id: int = PAD_ID) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists -> (int32 [B, T], int32 [B])."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  out = np.full((len(prompts), max(1, int(lengths.max(initial=1)))), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, : len(p)] = p
  return out, lengths


def prompt_cache_len(config, prompt_tokens: int, *, max_new_tokens: int, cache_len: int = 0) -> int:
  """The CLI's cache length (`--cache_len`, or 0: the prompt + `--max_new_tokens` - 1, the last new token not fed
  back), checked against the model.

  Raises ValueError naming --prompt (its token count, the limit, and --max_new_tokens' share of it) when the prompt
  and the tokens to generate do not fit in max_seq_len (or in an explicit --cache_len), and naming --cache_len when
  that exceeds max_seq_len.
  """
  limit, where = config.max_seq_len, f"max_seq_len={config.max_seq_len} of config {config.name!r}"
  if cache_len > limit:
    raise ValueError(f"--cache_len={cache_len} exceeds {where}")
  if cache_len:
    limit, where = cache_len, f"--cache_len={cache_len}"
  need = prompt_tokens + max_new_tokens - 1  # every new token but the last is fed back
  if need > limit:
    room = (f"shorten the prompt to at most {limit - max_new_tokens + 1} tokens or lower --max_new_tokens"
            if max_new_tokens <= limit else f"--max_new_tokens must be at most {limit}")
    raise ValueError(f"--prompt is {prompt_tokens} tokens; with --max_new_tokens={max_new_tokens} that needs "
                     f"{need} positions, more than {where}: {room}")
  return cache_len or need


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  from moe_jax import cli  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  for name in ("max_new_tokens", "batch"):
    if getattr(f, name) < 1:
      raise ValueError(f"--{name}={getattr(f, name)} must be >= 1")
  if f.cache_len < 0:
    raise ValueError(f"--cache_len={f.cache_len} must be >= 0 (0: prompt + max_new_tokens)")
  config, model, tok = cli.load_model(checkpoint=f.checkpoint, hf=f.hf, config=f.config, seed=f.seed)
  sampling = SamplingParams(temperature=f.temperature, top_k=f.top_k, top_p=f.top_p)
  try:
    prompt = tok.encode(f.prompt)
  except UnicodeError as e:  # bytes of the command line that are not UTF-8
    raise ValueError(f"--prompt is not UTF-8 text: {e}") from e
  tokens, lengths = pad_batch([prompt] * f.batch)
  cache_len = prompt_cache_len(config, len(prompt), max_new_tokens=f.max_new_tokens, cache_len=f.cache_len)
  decode.validate_prompts(config, tokens, lengths, cache_len=cache_len, max_new_tokens=f.max_new_tokens)
  cli.setup_kv_cache(model, f.kv_cache, calib_windows=f.kv_calib_windows, tokenizer=tok)  # after the cheap checks
  key = jax.random.key(f.seed)
  eos = getattr(tok, "eos_id", None)

  def run():
    t0 = time.perf_counter()
    logits, cache = decode.prefill(model, tokens, lengths, kv_cache=f.kv_cache, cache_len=cache_len, last_only=True)
    jax.block_until_ready(logits)
    t1 = time.perf_counter()
    out, n, cache = decode_loop(model, cache, logits, key,
                                *sampling.arrays(f.batch), max_new_tokens=f.max_new_tokens, eos_id=eos)
    jax.block_until_ready(out)
    return out, n, cache, t1 - t0, time.perf_counter() - t1

  run()  # compile
  out, n, cache, t_prefill, t_decode = run()
  out, n = np.asarray(out), np.asarray(n)
  for b in range(f.batch):
    print(f"[{b}] {f.prompt}{decode_continuation(tok, prompt, out[b, : n[b]])}")
  steps = int(n.max())  # tokens of the longest row: the first sampled from the prefill's logits, then steps - 1
  # decode steps; tokens/s counts the tokens generated (rows stopped at EOS generate fewer)
  print(f"config={config.name} batch={f.batch} prompt_tokens={len(prompt)} new_tokens={steps} "
        f"kv_cache={f.kv_cache} | prefill {t_prefill * 1e3:.2f} ms | decode {t_decode * 1e3 / max(steps - 1, 1):.3f} "
        f"ms/step | {int(n.sum()) / (t_prefill + t_decode):.1f} tokens/s | KV cache {cache.nbytes():,} bytes "
        f"| device {jax.devices()[0].device_kind}")


if __name__ == "__main__":
  from absl import app, flags

  from moe_jax import cli

  flags.DEFINE_string("config", "tiny", "Preset name (random weights).")
  flags.DEFINE_string("checkpoint", None, "Shipped checkpoint name (e.g. tiny-trained) or a checkpoint directory.")
  flags.DEFINE_string("hf", None, "Hugging Face model directory (config.json + safetensors + tokenizer.json).")
  flags.DEFINE_string("prompt", "def fibonacci(n):", "Prompt text.")
  flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
  flags.DEFINE_integer("batch", 1, "Copies of the prompt decoded together.")
  flags.DEFINE_integer("seed", 0, "PRNG seed (weights of --config models and sampling).")
  flags.DEFINE_float("temperature", 0.0, "0 for greedy.")
  flags.DEFINE_integer("top_k", 0, "0 disables top-k.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
  flags.DEFINE_string("kv_cache", "bf16", "KV cache mode: bf16, fp32, fp8, int8, kivi2, oskvp, oskvp3, oskvp_k3v2(_sym), "
                      "oskvp_static (calibrated at start on --kv_calib_windows training windows), ...")
  cli.define_kv_calib_windows()
  flags.DEFINE_integer("cache_len", 0, "KV cache positions (0: prompt + max_new_tokens - 1, the last new token is not "
                       "fed back).")
  app.run(main)
