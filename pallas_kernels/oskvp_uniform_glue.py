"""The jnp glue around the fused Mosaic GPU OS-KVP core (`oskvp_decode_core_mgpu.py`): the pieces
`moe_jax/kv_quant/oskvp_uniform_codes.uniform_decode_attention` composes with glue="xla" (the query digits and
outlier query, exact attention over the residual window, the log-sum-exp merge), and the references of the two
Triton kernels that replace them with glue="pallas" (`oskvp_uniform_prologue.py`, `oskvp_uniform_epilogue.py`).

With c = log2(e) / √H, a uniform codebook cb[c] = c0 + d·code per channel, q' = q U_k the rotated query:
  digits    qd = round(q'·d_k / u), u = max_ch |q'·d_k| / 127 per head; qs = u·c; const = c·Σ q'·c0_k
  window    softmax over the residual tokens in base 2, o' = Σ p·v' / Σ p, lse2 = log2 Σ 2^s
  merge     two attentions over disjoint tokens joined by their lse2 (an empty side has weight 0)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.oskvp_decode_core_mgpu import MASKED, N, OUTLIERS

LOG2E = 1.0 / math.log(2.0)


def uniform_steps(cb: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cb f32 [..., H, 4] uniform codebooks -> (c0 [..., H], d [..., H]), cb[c] = c0 + d·c."""
  return cb[..., 0], cb[..., 1] - cb[..., 0]


def query_digits(q_rot: jax.Array, cb_k: jax.Array, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q_rot f32 [BK, G, H], cb_k [BK, H, 4] -> (qd int8 [BK, 8, H], qs f32 [BK, 8], const f32 [BK, G]).

  qd = round(q'·d_k / u), u = max_ch |q'·d_k| / 127 per head (rows G.. zero); qs = u · scale · log2(e) turns the
  integer scores into base-2 logits; const = scale · log2(e) · q'·c0_k, the score part the codes do not carry.
  """
  bk, g, _ = q_rot.shape
  if g > N:
    raise ValueError(f"q_rot has G={g} query heads per kv head; the kernel takes at most {N}")
  c0, d = uniform_steps(cb_k.astype(jnp.float32))
  qf = q_rot.astype(jnp.float32) * d[:, None, :]  # [BK, G, H]
  u = jnp.maximum(jnp.max(jnp.abs(qf), axis=-1), 1e-30) / 127.0  # [BK, G]
  qd = jnp.round(qf / u[..., None]).astype(jnp.int8)
  pad = ((0, 0), (0, N - g))
  qd = jnp.pad(qd, (*pad, (0, 0)))
  qs = jnp.pad(u * (scale * LOG2E), pad)
  const = jnp.einsum("bgh,bh->bg", q_rot.astype(jnp.float32), c0) * (scale * LOG2E)
  return qd, qs, const


def outlier_query(q_rot: jax.Array, scale_k: jax.Array, scale: float) -> jax.Array:
  """q_rot f32 [BK, G, H], scale_k f32 [BK, 8] -> qo f16 [BK, 8, 8]: the key-outlier query q'[:, :8]·scale_k in base-2
  logits (rows G.. zero), the core's `qo`."""
  g = q_rot.shape[1]
  qo = q_rot[..., :OUTLIERS].astype(jnp.float32) * scale_k[:, None, :] * (scale * LOG2E)  # [BK, G, 8]
  return jnp.pad(qo, ((0, 0), (0, N - g), (0, 0))).astype(jnp.float16)


def window_attention(q_rot: jax.Array, res_k: jax.Array, res_v: jax.Array, n_res: jax.Array, *,
                     scale: float) -> tuple[jax.Array, jax.Array]:
  """Exact attention over the residual window: q_rot f32 [BK, G, H], res_k, res_v [BK, R, H] (rotated), n_res int32
  [BK] -> (o' f32 [BK, G, H], lse2 f32 [BK, G]) in the form `merge_lse2` takes (-inf and zeros without tokens)."""
  s = jnp.einsum("bgh,brh->bgr", q_rot, res_k.astype(jnp.float32)) * (scale * LOG2E)
  s = jnp.where(jnp.arange(res_k.shape[1])[None, None, :] < n_res[:, None, None], s, -jnp.inf)
  top = jnp.maximum(s.max(axis=-1), MASKED)
  p = jnp.exp2(s - top[..., None])
  total = p.sum(axis=-1)
  o = jnp.einsum("bgr,brh->bgh", p, res_v.astype(jnp.float32)) / jnp.maximum(total, 1e-30)[..., None]
  return o, jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30)), -jnp.inf)


def merge_lse2(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Joins two softmax attentions over disjoint token sets: o [..., H] with their log2-sum-exp2 [...] -> (o, lse2).

  A side with lse2 = -inf (no tokens) has weight 0; both empty gives zeros and -inf.
  """
  top = jnp.maximum(jnp.maximum(lse1, lse2), MASKED)
  w1, w2 = jnp.exp2(lse1 - top), jnp.exp2(lse2 - top)
  total = w1 + w2
  o = (w1[..., None] * o1 + w2[..., None] * o2) / jnp.maximum(total, 1e-30)[..., None]
  return o, jnp.where(total > 0, top + jnp.log2(jnp.maximum(total, 1e-30)), -jnp.inf)
