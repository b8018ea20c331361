"""Which side of the OS-KVP cache costs the model its bits per byte: keys or values, and what a third bit or per-block
codebooks buy on each.

Run:  python -m benchmarks.oskvp_bits_split [--checkpoint=tiny-trained] [--windows=16] [--out=benchmarks/results]
A teacher-forced pass over `--windows` validation windows of 512 tokens that reads keys and values as the decode path
stores them: a prefill of P = 256 tokens (exact attention there), then each query t reads the tokens before
R·floor(t / R) (R = 128, the flushed blocks) through the codes and the newer ones exactly, as `decode_step` does
with the cache flushing every R steps. Each side is fitted on the prefill (`OSKVPMode.fit`, keys RoPE-augmented) and
stored as:
  * "exact": not compressed;
  * "2-bit" / "3-bit": the prefill's fit (`oskvp` / `oskvp3`);
  * "2-bit, block codebooks": U and fp8 from the prefill, Lloyd-Max levels refitted on each flushed block (not a
    cache mode: the kernels apply one codebook per sequence; this measures what per-block codebooks would buy);
  * "kivi2": KIVI's 2-bit storage of that side (`moe_jax.kv_quant.kivi`: keys per channel over groups of 32 tokens,
    values per token over groups of 32 channels, f16 scale and zero), to compare the two 2-bit formats side by side;
  * "rotated kivi2": the same KIVI storage in OS-KVP's rotated basis (U fitted on the prefill as for "2-bit", no
    codebooks, no fp8 channels), to tell the rotation's part from the per-group ranges';
  * "kivi2, groups of N": KIVI's storage with groups of N tokens (keys) or N channels (values) instead of 32, to see
    how much of KIVI's edge is the groups' locality. Keys' groups of 128 are the flush blocks (storable); a group of
    the whole window (512) is an oracle, each token coded with the range of tokens that come after it too;
  * "2-bit, group scales": OS-KVP's fit (U, fp8 channels, Lloyd-Max codebooks) with each codebook row stretched by
    an f16 factor per group, KIVI's granularity on OS-KVP's levels: keys one factor per channel and 32-token group
    (+0.5 bit per element), values one per token (+16 / H bits). Not a cache mode: it asks whether OS-KVP's levels
    with KIVI's ranges would close the gap; "2-bit, group rms scales" matches each group's root-mean-square deviation
    to the levels' instead of its largest to the outer levels.
The first row (2-bit / 2-bit) is the `oskvp` cache: it reproduces the model-level eval's figure (README). Writes
`oskvp_bits_split_<device>.{json,md}` under --out: bits per byte against the exact pass's, per (keys, values) pair.
Shapes: B windows, T tokens, K kv heads, G query heads per kv head, H head dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report_files
from moe_jax import cli
from moe_jax import data as data_lib
from moe_jax.kv_quant import kivi
from moe_jax.kv_quant import oskvp
from moe_jax.kv_quant.oskvp_modes import OSKVPMode

CONTEXT, PREFIX, WINDOW = 512, 256, 128
PAIRS = (("2-bit", "2-bit"), ("exact", "2-bit"), ("2-bit", "exact"), ("3-bit", "2-bit"), ("2-bit", "3-bit"),
         ("3-bit", "3-bit"), ("2-bit, block codebooks", "2-bit"), ("2-bit", "2-bit, block codebooks"),
         ("2-bit, block codebooks", "2-bit, block codebooks"))


def _stored_head(x: jax.Array, p: oskvp.OSKVPParams, block_codebooks: bool) -> jax.Array:
  """One head's tokens x [T, H] as stored: the prefill's tokens with p, each later block of R with p or with its own
  Lloyd-Max levels (started from p's, the outlier rows kept)."""
  store = lambda xs, q: oskvp.dequantize(oskvp.quantize(xs, q), q)
  out = [store(x[:PREFIX], p)]
  for s in range(PREFIX, x.shape[0], WINDOW):
    blk, q = x[s:s + WINDOW], p
    if block_codebooks:
      levels, _ = oskvp.lloyd_max(blk @ p.u, jnp.ones(blk.shape[0]), p.codebook, oskvp.DEFAULT_LLOYD_ITERS)
      q = p.replace(codebook=levels.at[:p.n_outlier].set(p.codebook[:p.n_outlier]))
    out.append(store(blk, q))
  return jnp.concatenate(out)


def _group_scaled_head(x: jax.Array, p: oskvp.OSKVPParams, keys: bool, rms: bool = False) -> jax.Array:
  """One head's tokens x [T, H] (T a multiple of kivi.GROUP) as stored by "2-bit, group scales": p's U, fp8
  channels and codebooks, each codebook row stretched about its middle by an f16 factor that maps the largest
  deviation in a group onto the outer levels: for keys one factor per channel and 32-token group (KIVI's key groups,
  0.5 bit per element), for values one per token (16 / H bits per element) from all its coded channels together.
  rms: match the group's root-mean-square deviation to the levels' instead of its largest to the outer levels."""
  xr = x.astype(jnp.float32) @ p.u
  cb, o = p.codebook, p.n_outlier
  mid = 0.5 * (cb[:, 0] + cb[:, -1])
  half = jnp.maximum(0.5 * (cb[:, -1] - cb[:, 0]), 1e-30)
  spread = jnp.mean((cb - mid[:, None]) ** 2, axis=1)  # [H], the levels' mean square about the middle
  if keys:  # per channel: the group's largest deviation onto the outer levels, or its rms onto the levels'
    t, h = xr.shape
    groups = (xr - mid).reshape(t // kivi.GROUP, kivi.GROUP, h)
    f = (jnp.sqrt(jnp.mean(groups**2, axis=1) / jnp.maximum(spread, 1e-30)) if rms
         else jnp.max(jnp.abs(groups), axis=1) / half)
    f = jnp.repeat(f, kivi.GROUP, axis=0)
  else:  # per token, over the coded channels together (a channel whose levels nearly coincide must not dominate)
    dev = (xr - mid)[:, o:]
    f = (jnp.sqrt(jnp.sum(dev**2, axis=1, keepdims=True) / jnp.maximum(jnp.sum(spread[o:]), 1e-30)) if rms
         else jnp.max(jnp.abs(dev), axis=1, keepdims=True) / jnp.max(half[o:]))
  f = jnp.clip(f, 1e-6, 65504.0).astype(jnp.float16).astype(jnp.float32)  # finite f16 factors
  store = lambda z: oskvp.dequantize_rotated(oskvp.quantize_rotated(z, cb, p.scale), cb, p.scale)  # noqa: E731
  coded = mid + f * (store(mid + (xr - mid) / f) - mid)  # the scaled tokens fall within the codebook's range
  back = jnp.where(jnp.arange(xr.shape[1]) < o, store(xr), coded)  # fp8 channels as the cache stores them
  return back @ p.u.T


def _stored(x: jax.Array, how: str, mode: OSKVPMode, rope_span: int) -> jax.Array:
  """x [B, T, K, H] -> what the cache reads back for it under `how`."""
  if how == "exact":
    return x
  if how in ("kivi2", "rotated kivi2") or how.startswith("kivi2, groups of "):  # rope_span > 0 marks the keys
    group = int(how.rsplit(" ", 1)[1]) if how.startswith("kivi2, groups of ") else kivi.GROUP
    xt = jnp.swapaxes(x, 1, 2)  # [B, K, T, H]: groups of 32 tokens from position 0 (prefill and blocks align)
    u = None
    if how == "rotated kivi2":
      u = mode.fit(x[:, :PREFIX], jnp.full((x.shape[0],), PREFIX, jnp.int32), rope_span=rope_span, bits=2).u
      xt = jnp.einsum("BKTH,BKHJ->BKTJ", xt, u)  # u [B, K, H, H]
    if rope_span:
      back = kivi.dequantize_keys(*kivi.quantize_keys(xt, group))
    else:
      back = kivi.dequantize_values(*kivi.quantize_values(xt, group))
    if u is not None:
      back = jnp.einsum("BKTJ,BKHJ->BKTH", back, u)
    return jnp.swapaxes(back, 1, 2)
  bits = 3 if how.startswith("3") else 2
  params = mode.fit(x[:, :PREFIX], jnp.full((x.shape[0],), PREFIX, jnp.int32), rope_span=rope_span, bits=bits)
  if how in ("2-bit, group scales", "2-bit, group rms scales"):
    per_head = jax.vmap(jax.vmap(functools.partial(_group_scaled_head, keys=rope_span > 0, rms="rms" in how),
                                 in_axes=(1, 0), out_axes=1))
    return per_head(x, params)
  per_head = jax.vmap(jax.vmap(functools.partial(_stored_head, block_codebooks="block" in how), in_axes=(1, 0),
                               out_axes=1))
  return per_head(x, params)


def _logits(model, tokens: jax.Array, *, keys: str, values: str, mode: OSKVPMode) -> jax.Array:
  """tokens int32 [B, T] -> float32 logits [B, T, V] of the pass described in the module docstring."""
  b, t = tokens.shape
  ar = jnp.arange(t)
  positions = jnp.broadcast_to(ar, (b, t))
  n_comp = jnp.where(ar < PREFIX, 0, WINDOW * (ar // WINDOW))  # per query: tokens read through the codes
  coded = ar[None, :] < n_comp[:, None]  # [Tq, Tk]
  causal = ar[None, :] <= ar[:, None]
  x = model.embed(tokens)
  for block in model.blocks:
    q, k, v = (a.astype(jnp.float32) for a in block.attn.qkv(block.attn_norm(x), positions))
    k_hat, v_hat = _stored(k, keys, mode, t + 1), _stored(v, values, mode, 0)
    kh, h = k.shape[2], q.shape[-1]
    qg = q.reshape(b, t, kh, -1, h)  # [B, T, K, G, H]
    s = jnp.where(coded, jnp.einsum("BQKGH,BTKH->BKGQT", qg, k_hat), jnp.einsum("BQKGH,BTKH->BKGQT", qg, k))
    p = jax.nn.softmax(jnp.where(causal, s * h**-0.5, -jnp.inf), axis=-1)
    o = (jnp.einsum("BKGQT,BTKH->BQKGH", jnp.where(coded, p, 0.0), v_hat) +
         jnp.einsum("BKGQT,BTKH->BQKGH", jnp.where(coded, 0.0, p), v))
    x, _ = block.feed_forward(x + block.attn.out(o.reshape(q.shape).astype(x.dtype)))
  return model.unembed(x)


def bits_per_byte(logits: jax.Array, targets: jax.Array) -> float:
  """Mean -log2 p(target) over the decoded positions (PREFIX - 1 .. end: the prefill's last logits and each step's)."""
  lp = jax.nn.log_softmax(logits[:, PREFIX - 1:], axis=-1)
  return float(-jnp.mean(jnp.take_along_axis(lp, targets[:, PREFIX - 1:, None], axis=-1)) / np.log(2))


def run(model, config, windows: np.ndarray, pairs=PAIRS) -> list[dict]:
  """windows int32 [B, CONTEXT + 1] -> rows {keys, values, bpb, exact_bpb, rel}."""
  mode = dataclasses.replace(OSKVPMode().for_config(config), window=WINDOW)
  tokens, targets = jnp.asarray(windows[:, :CONTEXT]), jnp.asarray(windows[:, 1:])
  # The model is an argument, not a closed-over constant: its weights stay out of the HLO (36 MB of text a program).
  logits = nnx.jit(_logits, static_argnames=("keys", "values", "mode"))
  exact = bits_per_byte(logits(model, tokens, keys="exact", values="exact", mode=mode), targets)
  rows = []
  for keys, values in pairs:
    got = bits_per_byte(logits(model, tokens, keys=keys, values=values, mode=mode), targets)
    rows.append({"keys": keys, "values": values, "bpb": got, "exact_bpb": exact, "rel": got / exact - 1})
    print(rows[-1], flush=True)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", default="tiny-trained")
  p.add_argument("--windows", type=int, default=16)
  p.add_argument("--pairs", default="", help="keys/values;... (default: the module's PAIRS)")
  p.add_argument("--out", default="benchmarks/results")
  a = p.parse_args(argv)
  pairs = tuple(tuple(x.split("/")) for x in a.pairs.split(";")) if a.pairs else PAIRS
  config, model = cli.load_checkpoint(a.checkpoint)
  windows = data_lib.eval_windows(data_lib.load_corpus()["validation"].tokens, n_windows=a.windows, seq_len=CONTEXT)
  rows = run(model, config, windows, pairs)
  result = {"checkpoint": a.checkpoint, "windows": a.windows, "context": CONTEXT, "prefix": PREFIX, "window": WINDOW,
            "rows": rows}
  lines = [f"# OS-KVP: keys against values ({a.checkpoint}, {a.windows} windows of {CONTEXT}, prefill {PREFIX})", "",
           f"`python -m benchmarks.oskvp_bits_split`; exact pass {rows[0]['exact_bpb']:.4f} bits per byte.", "",
           "| keys | values | bits per byte | vs exact |", "|---|---|---|---|"]
  lines += [f"| {r['keys']} | {r['values']} | {r['bpb']:.4f} | {100 * r['rel']:+.2f}% |" for r in rows]
  report_files.write(a.out, "oskvp_bits_split", result, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
