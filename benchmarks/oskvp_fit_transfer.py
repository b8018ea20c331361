"""Does an OS-KVP fit made at prefill hold for the tokens decoded after it? Keys and values of a real model.

Run:  python -m benchmarks.oskvp_fit_transfer [--checkpoint=tiny-trained] [--windows=16] [--out=benchmarks/results]
For each layer of the checkpoint (its real post-RoPE keys and values on `--windows` validation windows of 512
tokens) and each prefix length P, `OSKVPMode.fit` on tokens [0, P) as a prefill does, then the relative error
|x_hat - x| / |x| of the stored tokens:
  * in-sample: the tokens [0, P) the fit saw;
  * later tokens [P, 512) with the prefill's fit (what decode stores);
  * later tokens with U kept and the codebooks (Lloyd-Max levels, fp8 centres and scales) refitted on them: what
    the basis alone transfers;
  * later tokens with the prefill's levels moved by the later tokens' channel means, by each 32-token block's means,
    or rescaled about the prefill's means to the later tokens' spread; and with Gaussian levels of the prefill's
    channel moments.
Writes `oskvp_fit_transfer_<device>.{json,md}` under --out. Shapes: N tokens, H head dim, O outlier channels.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks import report_files
from moe_jax import cli
from moe_jax import data as data_lib
from moe_jax.kv_quant import fidelity, oskvp
from moe_jax.kv_quant.oskvp_modes import OSKVPMode

CONTEXT = 512
COLUMNS = ("in-sample", "later, prefill fit", "later, U kept + codebooks refitted", "later, + later means",
           "later, + 32-token block means", "later, later spread", "later, Gaussian levels")


def _store(x: jax.Array, p: oskvp.OSKVPParams, shift: jax.Array) -> jax.Array:
  """x [N, H] through the codes of p with the levels moved by shift [N, H] (rotated basis) -> x_hat [N, H]."""
  xr = x @ p.u - shift
  code = oskvp.quantize_rotated(xr, p.codebook, p.scale)
  return (oskvp.dequantize_rotated(code, p.codebook, p.scale) + shift) @ p.u.T


def _variants(pre: jax.Array, later: jax.Array, p: oskvp.OSKVPParams, block: int = 32) -> tuple[jax.Array, ...]:
  """One head: pre [P, H], later [N, H] -> x_hat of each column of COLUMNS (in-sample: over pre; the others: later)."""
  o = p.scale.shape[0]
  xp, xl = pre @ p.u, later @ p.u
  mp = jnp.mean(xp, 0)
  zero = jnp.zeros_like(xl)
  levels, _ = oskvp.lloyd_max(xl, jnp.ones(xl.shape[0]), p.codebook, oskvp.DEFAULT_LLOYD_ITERS)
  centre = jnp.mean(xl[:, :o], 0)
  refit = oskvp.OSKVPParams(u=p.u, scale=jnp.max(jnp.abs(xl[:, :o] - centre), 0) * oskvp.HEADROOM / oskvp.FP8_MAX,
                            codebook=levels.at[:o].set(centre[:, None]))
  n = xl.shape[0]
  blocks = jnp.repeat(jnp.mean(xl[:n // block * block].reshape(-1, block, xl.shape[1]), 1), block, 0)
  blocks = jnp.concatenate([blocks, jnp.broadcast_to(blocks[-1:], (n - blocks.shape[0], xl.shape[1]))])
  ratio = (jnp.std(xl, 0) / jnp.maximum(jnp.std(xp, 0), 1e-6))[:, None]
  spread = p.replace(codebook=(mp[:, None] + ratio * (p.codebook - mp[:, None])).at[:o].set(p.codebook[:o]))
  g = jnp.asarray(oskvp.GAUSSIAN_LEVELS[p.codebook.shape[-1]], jnp.float32)
  gauss = p.replace(codebook=(mp[:, None] + jnp.std(xp, 0)[:, None] * g).at[:o].set(p.codebook[:o]))
  return (_store(pre, p, jnp.zeros_like(xp)), _store(later, p, zero), _store(later, refit, zero),
          _store(later, p, jnp.broadcast_to(jnp.mean(xl, 0) - mp, xl.shape)), _store(later, p, blocks - mp),
          _store(later, spread, zero), _store(later, gauss, zero))


# Every head's columns in one program per shape (op by op, each operation at a new shape compiled on its own).
_per_head = jax.jit(jax.vmap(jax.vmap(_variants, in_axes=(1, 1, 0)), in_axes=(0, 0, 0)))


def run(model, config, windows, prefixes=(128, 256)) -> list[dict]:
  """Rows {layer, prefix, kind, <column>: relative error} for every layer, prefix and keys/values."""
  mode = OSKVPMode().for_config(config)
  rows = []
  for layer, (_, k, v) in enumerate(fidelity.capture_qkv(model, windows)):
    for prefix in prefixes:
      for kind, x in (("keys", k), ("values", v)):
        lengths = jnp.full((x.shape[0],), prefix, jnp.int32)
        params = mode.fit(x[:, :prefix], lengths, rope_span=CONTEXT if kind == "keys" else 0)  # leading [B, K]
        outs = _per_head(x[:, :prefix], x[:, prefix:], params)  # each [B, K, N, H]
        pre, later = jnp.swapaxes(x[:, :prefix], 1, 2), jnp.swapaxes(x[:, prefix:], 1, 2)
        err = lambda a, ref: float(jnp.linalg.norm(a - ref) / jnp.linalg.norm(ref))
        rows.append({"layer": layer, "prefix": prefix, "kind": kind} |
                    {c: err(a, pre if i == 0 else later) for i, (c, a) in enumerate(zip(COLUMNS, outs))})
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", default="tiny-trained")
  p.add_argument("--windows", type=int, default=16)
  p.add_argument("--prefixes", default="128,256")
  p.add_argument("--out", default="benchmarks/results")
  a = p.parse_args(argv)
  config, model = cli.load_checkpoint(a.checkpoint)
  val = data_lib.load_corpus()["validation"].tokens
  windows = data_lib.eval_windows(val, n_windows=a.windows, seq_len=CONTEXT - 1)
  rows = run(model, config, windows, tuple(int(x) for x in a.prefixes.split(",")))
  result = {"checkpoint": a.checkpoint, "windows": a.windows, "context": CONTEXT, "rows": rows}
  lines = [f"# OS-KVP fit at prefill, on the tokens after it ({a.checkpoint}, {a.windows} windows of {CONTEXT})", "",
           "Relative error of the stored tokens (`python -m benchmarks.oskvp_fit_transfer`).", "",
           "| layer | P | kind | " + " | ".join(COLUMNS) + " |", "|---|---|---|" + "---|" * len(COLUMNS)]
  lines += [f"| {r['layer']} | {r['prefix']} | {r['kind']} | " + " | ".join(f"{r[c]:.3f}" for c in COLUMNS) + " |"
            for r in rows]
  report_files.write(a.out, "oskvp_fit_transfer", result, lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
