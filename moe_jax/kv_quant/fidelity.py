"""Fidelity of the KV cache modes: what each mode stores for given keys/values, and the attention error it causes.

Used by `moe_jax.kv_quant.report` and `notebooks/03_oskvp.ipynb`:
  * `synthetic_qkv`: post-RoPE keys with planted outlier channels (a few high-variance, offset channel pairs, as in
    real LLM keys), values with milder outliers, and queries;
  * `capture_qkv`: the real per-layer q, k, v of a model on given tokens (`Block.attn.qkv` on the normed input);
  * `stored_kv`: builds a mode's layer cache from k, v (`from_prefill`) and returns what it represents (dequantized,
    original basis) and its bytes, so the error is measured through the real storage path, residual window included;
  * `attention_error`: relative error of the attention output and KL(p ‖ p_hat) of the attention distributions.
Shapes: B batch, T tokens, Q queries scored, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.kv_cache import get_kv_cache_mode
from moe_jax.layers import rope


def synthetic_qkv(key: jax.Array, *, batch: int = 2, tokens: int = 2048, kv_heads: int = 2, q_per_kv: int = 2,
                  head_dim: int = 128, n_outlier_pairs: int = 3, outlier_std: float = 8.0,
                  theta: float = 1e4) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H]) f32, keys and queries rotated by RoPE.

  Keys: unit Gaussian channels plus `n_outlier_pairs` RoPE channel pairs (j, j + H/2) with std `outlier_std` and a
  mean offset of half that, drawn per kv head; values: Gaussian with one channel at 4x std; queries: Gaussian with
  the same outlier pairs at 2x std (real queries also weigh those channels).
  """
  kq, kk, kv_, kp = jax.random.split(key, 4)
  h2 = head_dim // 2
  std_k = np.ones((kv_heads, head_dim), np.float32)
  mean_k = np.zeros((kv_heads, head_dim), np.float32)
  std_q = np.ones((kv_heads, head_dim), np.float32)
  rng = np.random.default_rng(int(jax.random.randint(kp, (), 0, 2**31 - 1)))
  for g in range(kv_heads):
    pairs = rng.choice(h2, n_outlier_pairs, replace=False)
    for j in pairs:
      for c in (j, j + h2):
        std_k[g, c], mean_k[g, c], std_q[g, c] = outlier_std, 0.5 * outlier_std, 2.0
  k = jax.random.normal(kk, (batch, tokens, kv_heads, head_dim)) * std_k + mean_k
  v = jax.random.normal(kv_, (batch, tokens, kv_heads, head_dim)) * jnp.ones(head_dim).at[5].set(4.0)
  q = jax.random.normal(kq, (batch, tokens, kv_heads, q_per_kv, head_dim)) * std_q[:, None] * head_dim**-0.25 * 2
  q = q.reshape(batch, tokens, kv_heads * q_per_kv, head_dim)
  pos = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
  return rope(q, pos, theta), rope(k, pos, theta), v


@jax.jit
def _capture(model, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  x = model.embed(tokens)
  out = []
  for block in model.blocks:
    out.append(block.attn.qkv(block.attn_norm(x), positions))
    x, _, _ = block(x, positions)
  return out


def capture_qkv(model, tokens) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
  """Per layer (q [B, T, N, H], k [B, T, K, H], v [B, T, K, H]) of `model` on int32 tokens [B, T] (keys post-RoPE)."""
  return [tuple(a.astype(jnp.float32) for a in qkv) for qkv in _capture(model, jnp.asarray(tokens, jnp.int32))]


@functools.partial(jax.jit, static_argnames=("mode_name", "layer"))
def _store(k, v, mode_name, layer):
  b, t = k.shape[:2]
  cache = get_kv_cache_mode(mode_name).from_prefill(k, v, jnp.full((b,), t, jnp.int32), t, layer=layer)
  if hasattr(cache, "dequantized"):
    k_hat, v_hat = cache.dequantized()
  else:  # dense modes
    k_hat, v_hat = cache.k.astype(jnp.float32), cache.v.astype(jnp.float32)
  return k_hat[:, :t], v_hat[:, :t], cache


def stored_kv(mode_name: str, k: jax.Array, v: jax.Array, *, layer: int = 0):
  """What `mode_name` stores for full-length sequences k, v [B, T, K, H] of `layer` with cache_len = T.

  Returns:
    (k_hat, v_hat f32 [B, T, K, H], bits per stored element = 8·cache bytes / (2·B·T·K·H)).
  """
  k_hat, v_hat, cache = _store(k, v, mode_name, layer)
  nbytes = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(cache))
  return k_hat, v_hat, 8.0 * nbytes / (2 * k.size)


@jax.jit
def _attend(q, k, v, q_pos):
  """q [B, Q, N, H] at positions q_pos [Q] over k, v [B, T, K, H] causally -> (o [B, Q, N, H], p [B, K, G, Q, T])."""
  b, nq, n, h = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, nq, kh, n // kh, h)
  s = jnp.einsum("BQKGH,BTKH->BKGQT", qg, k) * h**-0.5
  s = jnp.where(jnp.arange(k.shape[1])[None, :] <= q_pos[:, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("BKGQT,BTKH->BQKGH", p, v).reshape(b, nq, n, h)
  return o, p


def attention_error(q, k, v, k_hat, v_hat, q_pos) -> dict[str, float]:
  """Attention-output relative error and score KL of (k_hat, v_hat) against (k, v).

  Args:
    q: [B, Q, N, H] queries at positions q_pos int32 [Q], each attending causally to keys <= its position.
    k, v, k_hat, v_hat: [B, T, K, H].

  Returns:
    {"rel_err": mean over queries and heads of |o_hat - o| / |o|, "kl": mean KL(p ‖ p_hat) in nats,
     "key_rel_err": |k_hat - k|_F / |k|_F, "value_rel_err": likewise}.
  """
  q_pos = jnp.asarray(q_pos, jnp.int32)
  o, p = _attend(q, k, v, q_pos)
  o_hat, p_hat = _attend(q, k_hat, v_hat, q_pos)
  rel = jnp.linalg.norm(o_hat - o, axis=-1) / jnp.maximum(jnp.linalg.norm(o, axis=-1), 1e-30)
  kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(jnp.maximum(p, 1e-30)) - jnp.log(jnp.maximum(p_hat, 1e-30))), 0.0), -1)
  return {"rel_err": float(jnp.mean(rel)), "kl": float(jnp.mean(kl)),
          "key_rel_err": float(jnp.linalg.norm(k_hat - k) / jnp.linalg.norm(k)),
          "value_rel_err": float(jnp.linalg.norm(v_hat - v) / jnp.linalg.norm(v))}


def mode_fidelity(mode_names, q, k, v, q_pos, *, layer: int = 0) -> dict[str, dict[str, float]]:
  """`attention_error` plus "bits_per_element" for each mode, on one set of q [B, Q, N, H], k, v [B, T, K, H]."""
  out = {}
  for name in mode_names:
    k_hat, v_hat, bits = stored_kv(name, k, v, layer=layer)
    out[name] = {"bits_per_element": bits, **attention_error(q, k, v, k_hat, v_hat, q_pos)}
  return out


def spectrum(x: jax.Array, *, outlier_fraction: float = 0.08) -> dict[str, np.ndarray | int | float]:
  """Channel statistics of keys or values x [N, H] before and after the OS-KVP rotation (for plots).

  Returns:
    {"channel_var": per-channel variance in the original basis [H], "rotated_var": variance of x @ U [H]
     (descending: the covariance spectrum), "n_outlier": O, "outlier_energy": share of the total variance in the
     first O rotated channels, "top_channel_energy": share in the O highest-variance original channels}.
  """
  from moe_jax.kv_quant import oskvp  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(x, jnp.float32)
  params = oskvp.calibrate(x, outlier_fraction=outlier_fraction)
  raw = np.var(np.asarray(x), axis=0)
  rot = np.var(np.asarray(x @ params.u), axis=0)
  o = params.n_outlier
  return {"channel_var": raw, "rotated_var": rot, "n_outlier": o,
          "outlier_energy": float(rot[:o].sum() / rot.sum()),
          "top_channel_energy": float(np.sort(raw)[::-1][:o].sum() / raw.sum())}
