"""vq2 expert weights: 8-bit indices into a k-means codebook of 256 four-dimensional vectors (2 bits per weight).

Per K group g of G rows and column n, the weights are normalised by their RMS; the normalised vectors of four
weights (slot j of vector r is k = g·G + r + (G/4)·j, the kernel's layout) are clustered by k-means (Lloyd, a fixed
number of iterations, deterministic initialisation from a strided sample) into 256 centroids, per expert or per
layer. The codebook is rounded to bf16, vectors are re-assigned to the rounded codebook, and the per-(group, column)
scale is refit by least squares: s = <w, c> / <c, c>.

Activation-weighted variant (`awq=True`, mode `vq2_awq`): with h_k = E[x_k^2] over the expert's calibration inputs
(normalised to mean 1 per expert, floored at 1e-3), the k-means distance, the centroid update and the scale refit
are weighted per coordinate by h at the weight's input channel: sum_k h_k (w_k - w_hat_k)^2 is the output error
E ||x (w - w_hat)||^2 when the channels are uncorrelated. The stored format and kernels are unchanged.

2:4 variant (`vq2_sp24`): prune as in `int4.prune_24`, then the four kept values of quads r and r + G/8 form one
vector: one index per 8 weights; with the 4-bit masks the total is still 2 bits per weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax.quant.formats import QuantizedExperts, VQ2SparseWeights
from moe_jax.quant.int4 import check_quantize_args, pad_k, padded_k, prune_24, quads
from pallas_kernels.vq2_grouped_matmul import VQ2Weights, pack_codebook, unpack_codebook

CODEBOOK_SIZE = 256


def _assign(v: jax.Array, cb: jax.Array, hw: jax.Array | None = None) -> jax.Array:
  """v: [P, 4], cb: [256, 4], hw: optional per-coordinate weights [P, 4] -> int32 [P] nearest centroid under
  sum_j hw_j (v_j - c_j)^2."""
  if hw is None:
    d = jnp.sum(cb ** 2, axis=1)[None, :] - 2.0 * v @ cb.T
  else:
    d = hw @ (cb ** 2).T - 2.0 * (hw * v) @ cb.T
  return jnp.argmin(d, axis=1).astype(jnp.int32)


def kmeans(v: jax.Array, *, iters: int = 20, hw: jax.Array | None = None) -> jax.Array:
  """Lloyd's k-means of v [P, 4] into 256 centroids [256, 4] (float32); empty clusters keep their centroid. hw:
  optional per-coordinate weights [P, 4] (weighted distance, weighted means)."""
  p = v.shape[0]
  init = v[(jnp.arange(CODEBOOK_SIZE) * max(p // CODEBOOK_SIZE, 1)) % p]
  init = init + 1e-3 * jnp.arange(CODEBOOK_SIZE, dtype=jnp.float32)[:, None] / CODEBOOK_SIZE  # break exact ties
  weights = jnp.ones_like(v) if hw is None else hw

  def step(cb, _):
    a = _assign(v, cb, hw)
    num = jax.ops.segment_sum(weights * v, a, num_segments=CODEBOOK_SIZE)
    den = jax.ops.segment_sum(weights, a, num_segments=CODEBOOK_SIZE)
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), cb), None

  cb, _ = jax.lax.scan(step, init, None, length=iters)
  return cb


def _fit(vecs: jax.Array, per: str, iters: int, hw: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """vecs [E, P, 4] (and optional weights hw [E, P, 4]) -> (packed codebook uint32 [C, 2, 256], idx int32 [E, P])
  against the bf16-rounded codebook."""
  if per == "expert":
    cb = jax.vmap(lambda v, h: kmeans(v, iters=iters, hw=h))(vecs, hw)  # hw None: an empty pytree
  elif per == "layer":
    cb = kmeans(vecs.reshape(-1, 4), iters=iters, hw=None if hw is None else hw.reshape(-1, 4))[None]
  else:
    raise ValueError(f"codebook={per!r} must be 'expert' or 'layer'")
  packed = pack_codebook(cb)
  cbr = jnp.broadcast_to(unpack_codebook(packed), (vecs.shape[0], CODEBOOK_SIZE, 4))
  idx = jax.vmap(_assign)(vecs, cbr, hw)
  return packed, idx


def channel_weights(calib_x: jax.Array, kp: int) -> jax.Array:
  """calib_x [E, R, K] (zero rows for padding) -> h [E, Kp] = E[x_k^2] over each expert's rows, normalised to mean 1
  and floored at 1e-3 (all ones for an expert without calibration rows); padded channels get the floor."""
  x = calib_x.astype(jnp.float32)
  rows = jnp.maximum(jnp.sum(jnp.any(x != 0, axis=2), axis=1), 1)[:, None]  # [E, 1]
  h = jnp.sum(x ** 2, axis=1) / rows  # [E, K]
  mean = jnp.mean(h, axis=1, keepdims=True)
  h = jnp.where(mean > 0, h / jnp.maximum(mean, 1e-30), 1.0)
  return jnp.maximum(pad_k(h[:, :, None], kp)[:, :, 0], 1e-3)


def _refit_scale(w: jax.Array, w_unit: jax.Array, h: jax.Array | None = None) -> jax.Array:
  """Least-squares scale per group column: w, w_unit [..., G, N] (and optional channel weights h [..., G, 1]) ->
  bf16 [..., N]."""
  h = 1.0 if h is None else h
  rms = _rms(w, axis=-2)  # the sum of G products w·c overflows float32 for |w| past ~1e37; fitted on w / rms
  s = jnp.sum(h * (w / rms) * w_unit, axis=-2) / jnp.maximum(jnp.sum(h * w_unit ** 2, axis=-2), 1e-12)
  return (s * rms[..., 0, :]).astype(jnp.bfloat16)


def _rms(x: jax.Array, axis) -> jax.Array:
  """RMS over `axis` (kept), 1 where all zero: computed on x / max|x| so that it neither overflows (|x| > ~1e19,
  where x² is inf in float32) nor vanishes beside an absolute epsilon (|x| < ~1e-12 quantized to zero before)."""
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  amax = jnp.where(amax > 0, amax, 1.0)
  rms = amax * jnp.sqrt(jnp.mean((x / amax) ** 2, axis=axis, keepdims=True))  # >= max|x| / sqrt(size)
  return jnp.where(rms > 0, rms, 1.0)


@functools.partial(jax.jit, static_argnames=("group_size", "codebook", "sparsity", "iters", "awq"))
def quantize_vq2(w: jax.Array, *, group_size: int = 128, codebook: str = "expert", sparsity: str | None = None,
                 calib_x: jax.Array | None = None, iters: int = 20, awq: bool = False) -> QuantizedExperts:
  """Quantizes an expert weight [E, K, N] to vq2 (or vq2_sp24 with sparsity="2:4").

  Args:
    w: [E, K, N] float.
    group_size: G (a multiple of 64; 128 or more with 2:4).
    codebook: "expert" (one codebook per expert) or "layer" (one shared by all experts of the weight).
    sparsity: None or "2:4".
    calib_x: [E, R, K] calibration inputs (2:4 saliency; the channel weights of awq).
    iters: k-means iterations.
    awq: weight the k-means and the scale refit by the calibration inputs' E[x_k^2] (module docstring); dense only.
  """
  check_quantize_args(w, group_size=group_size, sparsity=sparsity, calib_x=calib_x, awq=False, min_group=64)
  if not isinstance(iters, int) or iters < 1:
    raise ValueError(f"iters={iters!r} must be a positive int (k-means iterations)")
  if awq and (calib_x is None or sparsity is not None):
    raise ValueError("awq=True needs calib_x, the experts' calibration inputs, and dense weights (sparsity=None)")
  e, k, n = w.shape
  kp = padded_k(k, group_size)
  ng, quarter, eighth = kp // group_size, group_size // 4, group_size // 8
  w = pad_k(w.astype(jnp.float32), kp)
  wq = quads(w, group_size)  # [E, Kg, 4, G/4, N]
  if sparsity is None:
    rms = _rms(wq, axis=(2, 3))  # [E, Kg, 1, 1, N]
    vecs = jnp.moveaxis(wq / rms, 2, -1)  # [E, Kg, G/4, N, 4]
    h = channel_weights(calib_x, kp) if awq else None  # [E, Kp]
    hw = None
    if awq:  # coordinate j of vector r in group g sits at k = g G + r + (G/4) j
      hv = jnp.moveaxis(h.reshape(e, ng, 4, quarter), 2, -1)[:, :, :, None, :]  # [E, Kg, G/4, 1, 4]
      hw = jnp.broadcast_to(hv, vecs.shape).reshape(e, -1, 4)
    packed, idx = _fit(vecs.reshape(e, -1, 4), codebook, iters, hw)
    cb = jnp.broadcast_to(unpack_codebook(packed), (e, CODEBOOK_SIZE, 4))
    unit = jax.vmap(lambda c, i: c[i])(cb, idx).reshape(e, ng, quarter, n, 4)
    unit = jnp.moveaxis(unit, -1, 2).reshape(e, ng, group_size, n)
    scale = _refit_scale(w.reshape(e, ng, group_size, n), unit,
                         None if h is None else h.reshape(e, ng, group_size, 1))
    data = VQ2Weights(idx.reshape(e, kp // 4, n).astype(jnp.uint8), packed, scale, None)
    return QuantizedExperts(data, kind="vq2", k=k, group_size=group_size)
  x = None if calib_x is None else pad_k(jnp.swapaxes(calib_x.astype(jnp.float32), 1, 2), kp).swapaxes(1, 2)
  h = None if x is None else jnp.mean(x ** 2, axis=1)
  keep = quads(prune_24(w, group_size, h), group_size)  # [E, Kg, 4, G/4, N]
  rank = jnp.cumsum(keep, axis=2)
  vals = jnp.stack([jnp.sum(jnp.where(keep & (rank == i), wq, 0.0), axis=2) for i in (1, 2)], -1)  # [E,Kg,G/4,N,2]
  mask = jnp.sum(keep.astype(jnp.int32) << jnp.arange(4)[None, None, :, None, None], axis=2)  # [E, Kg, G/4, N]
  rms = _rms(vals, axis=(2, 4))  # [E, Kg, 1, N, 1]
  vecs = jnp.concatenate([vals[:, :, :eighth], vals[:, :, eighth:]], axis=-1) / rms  # [E, Kg, G/8, N, 4]
  packed, idx = _fit(vecs.reshape(e, -1, 4), codebook, iters)
  cb = jnp.broadcast_to(unpack_codebook(packed), (e, CODEBOOK_SIZE, 4))
  unit = jax.vmap(lambda c, i: c[i])(cb, idx).reshape(e, ng, eighth, n, 4)
  unit_vals = jnp.concatenate([unit[..., 0:2], unit[..., 2:4]], axis=2)  # [E, Kg, G/4, N, 2]
  s = jnp.sum(vals / rms * unit_vals, axis=(2, 4)) / jnp.maximum(jnp.sum(unit_vals ** 2, axis=(2, 4)), 1e-12)
  s = s * rms[:, :, 0, :, 0]  # fitted on vals / rms: the sum overflows float32 for |w| past ~1e37
  meta = (mask[:, :, :eighth] | (mask[:, :, eighth:] << 4)).astype(jnp.uint8).reshape(e, kp // 8, n)
  data = VQ2SparseWeights(idx.reshape(e, kp // 8, n).astype(jnp.uint8), meta, packed, s.astype(jnp.bfloat16), None)
  return QuantizedExperts(data, kind="vq2_sp24", k=k, group_size=group_size)
