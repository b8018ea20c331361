"""int4 expert weights: group-wise asymmetric round-to-nearest, an activation-aware (AWQ-style) variant, and 2:4
micro-sparsity. Pure jnp (traceable), so `jax.eval_shape` gives the quantized structure without computing it.

Math, per expert, K group g of G rows and column n (Kp = K padded to a multiple of G with zero rows):
  RTN:  lo, hi = min(w, 0), max(w, 0) over the group column; s = (hi - lo) / 15 (stored bf16); z = round(-lo / s);
        q = clip(round(w / s) + z, 0, 15); w_hat = (q - z) · s.
  AWQ:  with calibration rows X_e [R, K] of the expert's real inputs, per-input-channel scales
        a_k = mean|X[:, k]|^alpha (normalised to geometric mean 1), alpha on a grid in [0, 1] chosen per expert to
        minimise ||X_e (W - diag(1/a) Q(diag(a) W))||_F; then per (group, column) a clipping ratio on a grid in
        [0.7, 1] of the range, chosen to minimise sum_k E[x_k^2] / a_k^2 · (w'_kn - w_hat'_kn)^2. The kernel
        multiplies lhs by `in_scale` = 1/a.
  2:4:  K group g splits into quads (quad r: k = g·G + r + (G/4)·j, j = 0..3); the two of four with the smallest
        saliency |w|·sqrt(E[x^2]) (|w| without calibration) are pruned; scale and zero come from the kept weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax.quant.formats import QuantizedExperts
from pallas_kernels.int4_grouped_matmul import Int4Weights, to_nk_layout

ALPHAS = tuple(i / 10 for i in range(11))
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def check_quantize_args(w, *, group_size, sparsity, calib_x, awq: bool, min_group: int) -> None:
  """Raises ValueError naming the argument for inputs `quantize_int4` / `quantize_vq2` cannot quantize (shapes only,
  so it costs nothing under jit). min_group: the dense format's group granularity (32 int4, 64 vq2)."""
  if sparsity not in (None, "2:4"):
    raise ValueError(f"sparsity={sparsity!r} must be None or '2:4'")
  step = 128 if sparsity else min_group
  if not isinstance(group_size, int) or group_size < step or group_size % step:
    raise ValueError(f"group_size={group_size!r} must be a positive multiple of {step}"
                     + (" with sparsity='2:4'" if sparsity else ""))
  if awq and calib_x is None:
    raise ValueError("awq=True needs calib_x, the experts' calibration inputs")
  if len(w.shape) != 3:
    raise ValueError(f"w must be an expert weight [E, K, N], got shape {tuple(w.shape)}")
  if calib_x is not None and (len(calib_x.shape) != 3 or calib_x.shape[0] != w.shape[0]
                              or calib_x.shape[2] != w.shape[1]):
    raise ValueError(f"calib_x must be [E, R, K] = [{w.shape[0]}, R, {w.shape[1]}] for w of shape {tuple(w.shape)}, "
                     f"got {tuple(calib_x.shape)}")


def padded_k(k: int, group_size: int) -> int:
  return -(-k // group_size) * group_size


def pad_k(w: jax.Array, kp: int) -> jax.Array:
  """[E, K, N] -> [E, Kp, N] with zero rows."""
  return jnp.pad(w, ((0, 0), (0, kp - w.shape[1]), (0, 0)))


def quads(w: jax.Array, group_size: int) -> jax.Array:
  """[E, Kp, N] -> [E, Kg, 4, G/4, N]: axis 2 is the slot j, axis 3 the quad r (k = g·G + r + (G/4)·j)."""
  e, kp, n = w.shape
  return w.reshape(e, kp // group_size, 4, group_size // 4, n)


@functools.partial(jax.jit, static_argnames=("group_size",))
def prune_24(w: jax.Array, group_size: int, importance: jax.Array | None = None) -> jax.Array:
  """Keep mask (bool [E, Kp, N]) of the two most salient weights of every quad.

  Args:
    w: [E, Kp, N].
    importance: [E, Kp] mean squared input per channel (None: magnitude only).
  """
  mag = quads(jnp.abs(w), group_size)
  if importance is None:
    order = jnp.argsort(mag, axis=2)
  else:  # saliency |w|·sqrt(E[x²]), ties (channels no calibration row reached) broken by magnitude
    sal = quads(jnp.abs(w) * jnp.sqrt(importance)[:, :, None], group_size)
    by_mag = jnp.argsort(mag, axis=2)
    order = jnp.take_along_axis(by_mag, jnp.argsort(jnp.take_along_axis(sal, by_mag, axis=2), axis=2, stable=True),
                                axis=2)
  rank = jnp.argsort(order, axis=2)  # 0 = least salient
  return (rank >= 2).reshape(w.shape)


def _rtn(wg: jax.Array, keep: jax.Array | None, ratio: jax.Array | float = 1.0):
  """Asymmetric 4-bit RTN of [..., G, N] groups (over axis -2) -> (q int32, scale bf16 [..., 1, N], zero int32)."""
  big = jnp.finfo(jnp.float32).max
  lo = jnp.min(wg if keep is None else jnp.where(keep, wg, big), axis=-2, keepdims=True)
  hi = jnp.max(wg if keep is None else jnp.where(keep, wg, -big), axis=-2, keepdims=True)
  lo, hi = jnp.minimum(lo, 0.0) * ratio, jnp.maximum(hi, 0.0) * ratio
  # hi/15 − lo/15, not (hi − lo)/15: the difference overflows for weights past half of float32's range
  scale = jnp.maximum(hi / 15.0 - lo / 15.0, jnp.finfo(jnp.bfloat16).tiny).astype(jnp.bfloat16)  # 0 only for 0 groups
  s = scale.astype(jnp.float32)
  zero = jnp.clip(jnp.round(-lo / s), 0, 15).astype(jnp.int32)
  q = jnp.clip(jnp.round(wg / s) + zero, 0, 15).astype(jnp.int32)
  if keep is not None:
    q = jnp.where(keep, q, zero)
  return q, scale, zero


def _fake_quant(wg, keep, ratio=1.0):
  q, scale, zero = _rtn(wg, keep, ratio)
  return (q - zero).astype(jnp.float32) * scale.astype(jnp.float32)


def _groups(w: jax.Array, group_size: int) -> jax.Array:
  e, kp, n = w.shape
  return w.reshape(e, kp // group_size, group_size, n)


def awq_scales(w: jax.Array, x: jax.Array, group_size: int, keep: jax.Array | None = None) -> jax.Array:
  """Per-expert activation scales a [E, Kp] minimising the calibration output error.

  Args:
    w: [E, Kp, N] float32.
    x: [E, R, Kp] calibration inputs routed to each expert (zero rows for padding).
    keep: optional 2:4 keep mask [E, Kp, N].
  """
  mean_abs = jnp.sum(jnp.abs(x), axis=1) / jnp.maximum(jnp.sum(jnp.any(x != 0, axis=2), axis=1), 1)[:, None]
  # A channel no calibration row reached (K padding, or quiet at calibration) is scaled as the typical channel
  # (a = 1): floored at 1e-6, it was shrunk ~1e3-fold, its weights quantized to 0 and 1/a made the kernels'
  # x · (1/a) overflow float16 and cancel badly if the channel is active at inference.
  seen = mean_abs > 0  # [E, Kp]
  log_mean = jnp.sum(jnp.where(seen, jnp.log(jnp.where(seen, mean_abs, 1.0)), 0.0), axis=1, keepdims=True)
  typical = jnp.exp(log_mean / jnp.maximum(jnp.sum(seen, axis=1, keepdims=True), 1))  # geometric mean of the seen
  mean_abs = jnp.maximum(jnp.where(seen, mean_abs, typical), 1e-6)  # [E, Kp]

  def err_for(alpha):
    a = mean_abs ** alpha
    a = a / jnp.exp(jnp.mean(jnp.log(a), axis=1, keepdims=True))
    wq = _fake_quant(_groups(w * a[:, :, None], group_size),
                     None if keep is None else _groups(keep, group_size)).reshape(w.shape) / a[:, :, None]
    return jnp.sum(jnp.einsum("ERK,EKN->ERN", x, w - wq) ** 2, axis=(1, 2)), a

  # lax.map: one traced body, candidates evaluated in sequence (memory of one candidate at a time).
  errs, scales = jax.lax.map(err_for, jnp.asarray(ALPHAS, jnp.float32))  # [A, E], [A, E, Kp]
  best = jnp.argmin(errs, axis=0)  # [E]
  return jnp.take_along_axis(scales, best[None, :, None], axis=0)[0]


def clip_ratios(w: jax.Array, h: jax.Array, group_size: int, keep: jax.Array | None = None) -> jax.Array:
  """Per (group, column) range ratio [E, Kg, 1, N] minimising sum_k h_k (w - w_hat)^2 (h: [E, Kp])."""
  wg = _groups(w, group_size)
  hg = h.reshape(wg.shape[:3])[..., None]
  kg = None if keep is None else _groups(keep, group_size)
  ratios = jnp.asarray(CLIP_RATIOS, jnp.float32)
  errs = jax.lax.map(lambda r: jnp.sum(hg * (wg - _fake_quant(wg, kg, r)) ** 2, axis=2, keepdims=True), ratios)
  return ratios[jnp.argmin(errs, axis=0)]


@functools.partial(jax.jit, static_argnames=("group_size", "sparsity", "awq"))
def quantize_int4(w: jax.Array, *, group_size: int = 128, sparsity: str | None = None,
                  calib_x: jax.Array | None = None, awq: bool = False) -> QuantizedExperts:
  """Quantizes an expert weight.

  Args:
    w: [E, K, N] float.
    group_size: G (a multiple of 32; 128 or more with 2:4).
    sparsity: None or "2:4".
    calib_x: [E, R, K] the experts' calibration inputs (zero-padded rows); needed for awq, used by 2:4 saliency.
    awq: activation-aware scales and clipping (needs calib_x).

  Returns:
    QuantizedExperts of kind "int4" or "int4_sp24".
  """
  check_quantize_args(w, group_size=group_size, sparsity=sparsity, calib_x=calib_x, awq=awq, min_group=32)
  e, k, n = w.shape
  kp = padded_k(k, group_size)
  w = pad_k(w.astype(jnp.float32), kp)
  x = None if calib_x is None else pad_k(jnp.swapaxes(calib_x.astype(jnp.float32), 1, 2), kp).swapaxes(1, 2)
  h = None if x is None else jnp.sum(x ** 2, axis=1) / jnp.maximum(jnp.sum(jnp.any(x != 0, axis=2), axis=1),
                                                                   1)[:, None]  # [E, Kp] mean x^2 per channel
  keep = prune_24(w, group_size, h) if sparsity else None
  in_scale, ratio = None, 1.0
  if awq:
    a = awq_scales(w, x, group_size, keep)
    w = w * a[:, :, None]
    ratio = clip_ratios(w, h / a ** 2, group_size, keep)
    in_scale = (1.0 / a).astype(jnp.float32)
  q, scale, zero = _rtn(_groups(w, group_size), None if keep is None else _groups(keep, group_size), ratio)
  scale, zero = scale[:, :, 0], zero[:, :, 0].astype(jnp.uint8)  # [E, Kg, N]
  if keep is None:
    half = group_size // 2
    packed = (q[:, :, :half] | (q[:, :, half:] << 4)).astype(jnp.uint8).reshape(e, kp // 2, n)
    # Stored in the kernel's uint16 [E, N, Kp/4] layout (the A/B-swapped decode kernel reads it directly).
    data = to_nk_layout(Int4Weights(packed, scale, zero, in_scale, None), group_size=group_size)
    return QuantizedExperts(data, kind="int4", k=k, group_size=group_size)
  qq, kq = quads(q.reshape(e, kp, n), group_size), quads(keep, group_size)  # [E, Kg, 4, G/4, N]
  rank = jnp.cumsum(kq, axis=2)
  v0 = jnp.sum(jnp.where(kq & (rank == 1), qq, 0), axis=2)
  v1 = jnp.sum(jnp.where(kq & (rank == 2), qq, 0), axis=2)
  mask = jnp.sum(kq.astype(jnp.int32) << jnp.arange(4)[None, None, :, None, None], axis=2)  # [E, Kg, G/4, N]
  eighth = group_size // 8
  packed = (v0 | (v1 << 4)).astype(jnp.uint8).reshape(e, kp // 4, n)
  meta = (mask[:, :, :eighth] | (mask[:, :, eighth:] << 4)).astype(jnp.uint8).reshape(e, kp // 8, n)
  data = Int4Weights(packed, scale, zero, in_scale, meta)
  return QuantizedExperts(data, kind="int4_sp24", k=k, group_size=group_size)
