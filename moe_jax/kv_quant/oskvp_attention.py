"""Decode attention over an OS-KVP cache: the XLA reference (lookup-table and dequantize-then-dot forms) and the
`implementation=` switch to the Pallas kernel.

Per sequence b and kv head k, for the G queries of its group (q unrotated, [G, H]):
  q' = q @ U_k
  score_s = q'·k'_hat_s / sqrt(H) over the compressed tokens s < n_comp and the residual tokens r < n_res, where the
    compressed k'_hat_s[j] = cb_k[j, code_sj] + (j < O ? outl_sj·scale_j : 0) and the residual keys are stored rotated;
  p = softmax(score) in float32;
  o' = Σ_s p_s v'_hat_s + Σ_r p_r res_v_r;   o = o' @ U_vᵀ.
Lookup-table form: the key term is Σ_j T[j, code_sj] with T[j, l] = q'_j·cb_k[j, l] (a [G, H, L] table built once per
step), and the value term is o'_j = Σ_l P[j, l]·cb_v[j, l] with P[j, l] = Σ_s p_s [code_sj = l]. Dequantize-then-dot
materializes k'_hat and v'_hat. Both are exact rewrites of each other; the tests check they agree.
Shapes: B batch, N = K·G query heads, K kv heads, S compressed capacity, R residual window, H head dim, O outlier
channels, L codebook levels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax import backend
from moe_jax.kv_quant.oskvp import unpack1, unpack2

IMPLEMENTATIONS = ("auto", "pallas", "xla")


def _levels(codes: jax.Array, hi: jax.Array | None) -> jax.Array:
  """Packed [B, K, S, H/4] (+ [B, K, S, H/8]) -> int32 level indices [B, K, S, H]."""
  idx = unpack2(codes)
  if hi is not None:
    idx = idx | (unpack1(hi) << 2)
  return idx.astype(jnp.int32)


def dequantize_store(codes: jax.Array, outl: jax.Array, scale: jax.Array, cb: jax.Array,
                     hi: jax.Array | None = None) -> jax.Array:
  """Compressed store -> rotated f32 [B, K, S, H].

  Args:
    codes: uint8 [B, K, S, H/4]; outl: float8 [B, K, S, O]; scale: f32 [B, K, O]; cb: f32 [B, K, H, L];
    hi: uint8 [B, K, S, H/8] or None.
  """
  idx = _levels(codes, hi)
  onehot = jax.nn.one_hot(idx, cb.shape[-1], dtype=jnp.float32)  # [B, K, S, H, L]
  xr = jnp.einsum("BKSHL,BKHL->BKSH", onehot, cb)
  o = scale.shape[-1]
  return xr.at[..., :o].add(outl.astype(jnp.float32) * scale[:, :, None, :])


@functools.partial(jax.jit, static_argnames=("form",))
def compressed_scores(qr: jax.Array, codes, outl, scale, cb, hi=None, *, form: str = "lut") -> jax.Array:
  """Unscaled q'·k'_hat over the compressed store.

  Args:
    qr: f32 [B, K, G, H] rotated queries. Store fields as in `dequantize_store`.
    form: "lut" (per-channel q'·centroid tables summed over codes) or "dequant" (dequantize, then dot).

  Returns:
    f32 [B, K, G, S].
  """
  if form == "dequant":
    return jnp.einsum("BKGH,BKSH->BKGS", qr, dequantize_store(codes, outl, scale, cb, hi))
  if form != "lut":
    raise ValueError(f"form={form!r} must be 'lut' or 'dequant'")
  o = scale.shape[-1]
  table = jnp.einsum("BKGH,BKHL->BKGHL", qr, cb)  # [B, K, G, H, L]
  onehot = jax.nn.one_hot(_levels(codes, hi), cb.shape[-1], dtype=jnp.float32)  # [B, K, S, H, L]
  code_part = jnp.einsum("BKSHL,BKGHL->BKGS", onehot, table)
  outl_part = jnp.einsum("BKSO,BKGO->BKGS", outl.astype(jnp.float32), qr[..., :o] * scale[:, :, None, :])
  return code_part + outl_part


@functools.partial(jax.jit, static_argnames=("form",))
def compressed_values(p: jax.Array, codes, outl, scale, cb, hi=None, *, form: str = "lut") -> jax.Array:
  """Σ_s p_s v'_hat_s over the compressed store: p f32 [B, K, G, S] -> f32 [B, K, G, H] (rotated basis)."""
  if form == "dequant":
    return jnp.einsum("BKGS,BKSH->BKGH", p, dequantize_store(codes, outl, scale, cb, hi))
  if form != "lut":
    raise ValueError(f"form={form!r} must be 'lut' or 'dequant'")
  o = scale.shape[-1]
  onehot = jax.nn.one_hot(_levels(codes, hi), cb.shape[-1], dtype=jnp.float32)
  mass = jnp.einsum("BKGS,BKSHL->BKGHL", p, onehot)  # P[j, l]
  out = jnp.einsum("BKGHL,BKHL->BKGH", mass, cb)
  outl_part = jnp.einsum("BKGS,BKSO->BKGO", p, outl.astype(jnp.float32)) * scale[:, :, None, :]
  return out.at[..., :o].add(outl_part)


@functools.partial(jax.jit, static_argnames=("form",))
def oskvp_decode_attention_xla(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k,
                               res_v, n_comp, n_res, *, hi_k=None, hi_v=None, form: str = "lut") -> jax.Array:
  """One query per head over compressed + residual tokens (see the module docstring for the math).

  Args:
    q: [B, N, H] unrotated queries.
    codes_k, codes_v: uint8 [B, K, S, H/4]; outl_k, outl_v: float8_e4m3fn [B, K, S, O]; scale_k, scale_v: f32
      [B, K, O]; cb_k, cb_v: f32 [B, K, H, L]; u_k, u_v: f32 [B, K, H, H]; res_k, res_v: bf16 [B, K, R, H] (rotated);
      n_comp, n_res: int32 [B]; hi_k, hi_v: uint8 [B, K, S, H/8] for 3-bit codes, else None.
    form: "lut" or "dequant".

  Returns:
    [B, N, H] in q's dtype.
  """
  b, n, h = q.shape
  kh, s, r = codes_k.shape[1], codes_k.shape[2], res_k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, kh, n // kh, h)
  qr = jnp.einsum("BKGH,BKHJ->BKGJ", qg, u_k)
  sc = compressed_scores(qr, codes_k, outl_k, scale_k, cb_k, hi_k, form=form)  # [B, K, G, S]
  sr = jnp.einsum("BKGH,BKRH->BKGR", qr, res_k.astype(jnp.float32))
  vis_c = (jnp.arange(s)[None, :] < n_comp[:, None])[:, None, None, :]  # [B, 1, 1, S]
  vis_r = (jnp.arange(r)[None, :] < n_res[:, None])[:, None, None, :]
  scores = jnp.concatenate([jnp.where(vis_c, sc, -jnp.inf), jnp.where(vis_r, sr, -jnp.inf)], axis=-1) * h**-0.5
  probs = jax.nn.softmax(scores, axis=-1)
  pc, pr = probs[..., :s], probs[..., s:]
  out = compressed_values(pc, codes_v, outl_v, scale_v, cb_v, hi_v, form=form)
  out = out + jnp.einsum("BKGR,BKRH->BKGH", pr, res_v.astype(jnp.float32))
  out = jnp.einsum("BKGJ,BKHJ->BKGH", out, u_v)  # o' @ U_vᵀ
  return out.reshape(b, n, h).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "symmetric_codebooks"))
def oskvp_decode_attention(q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v,
                           n_comp, n_res, *, hi_k=None, hi_v=None, implementation: str = "auto",
                           interpret: bool = False, symmetric_codebooks: bool = False) -> jax.Array:
  """Decode attention over an OS-KVP cache, through `implementation` ("auto", "pallas" or "xla"; arguments as in
  `oskvp_decode_attention_xla`). "auto" is the Pallas kernel on GPU and the XLA reference elsewhere. On the
  H200 at 64k context x batch 8 the kernel (bit-plane form, compact rows) takes 0.477 ms (0.426 with symmetric
  codebooks) against 1.88 for the XLA reference and 0.534 for cuDNN on a bf16 cache
  (benchmarks/results/decode_attention.md). The Pallas kernel reads 2-bit values, and 2- or 3-bit keys where
  `supports_key_high_bits` (the compact bit-plane form: head dim >= 128, G <= 8); other caches (3-bit values, 3-bit
  keys at head dim 64 or G = 16) fall back to "xla", and so under "auto" do shapes the kernel does not take
  (`kernel_shape_problem`: e.g. head dim 32, no outlier channels; "pallas" names them). symmetric_codebooks: the
  caches of `OSKVPMode(symmetric=True)`; lets the kernel skip a plane type."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
  auto = implementation == "auto"
  if auto:
    implementation = "pallas" if backend.on_gpu() else "xla"
  args = (q, codes_k, outl_k, scale_k, cb_k, codes_v, outl_v, scale_v, cb_v, u_k, u_v, res_k, res_v, n_comp, n_res)
  if implementation == "pallas" and hi_v is None:
    # Imported here: the kernel lives in pallas_kernels/ and the XLA path must work without it.
    from pallas_kernels import oskvp_decode_attention as kernel  # pylint: disable=g-import-not-at-top
    if auto and kernel.kernel_shape_problem(q, codes_k, outl_k, outl_v, res_k) is not None:
      return oskvp_decode_attention_xla(*args, hi_k=hi_k, hi_v=hi_v)  # e.g. head dim 32: "pallas" would name why
    if hi_k is None or kernel.supports_key_high_bits(q.shape[-1], q.shape[1] // codes_k.shape[1]):
      return kernel.oskvp_decode_attention(*args, hi_k=hi_k, interpret=interpret,
                                           symmetric_codebooks=symmetric_codebooks)
  return oskvp_decode_attention_xla(*args, hi_k=hi_k, hi_v=hi_v)
