"""OS-KVP: Orthogonal Subspace KV Projection, one kv head's quantizer (calibrate, quantize, dequantize).

The math, for a matrix x [N, H] of keys (taken AFTER RoPE, so q·k = (qU)·(kU) stays exact and decode needs no
re-rotation) or of values:
  1. U [H, H] = eigenvectors of the channel covariance of x, columns sorted by DESCENDING variance; x' = x @ U.
  2. The first O rotated channels (the highest-variance, "outlier" subspace), O = max(8, round(f·H/8)·8), are kept in
     float8 e4m3 about their centre m_j (the prefill mean) with a per-channel scale
     s_j = max(HEADROOM·amax|x'_j - m_j|, HEADROOM·amax|x'_j| + |m_j|) / 448 (floored, see `fit`; the range
     m ± 448·s holds the uncentred ±HEADROOM·amax|x'_j|): outl = (x'[:, :O] - m) / s.
  3. Every channel gets a code into its own L = 2**bits level codebook cb [H, L] (sorted ascending), fitted by
     Lloyd-Max iterations initialised at the Gaussian-optimal levels mean_j + std_j·g. An outlier channel's codebook
     row is constant, all levels m_j, and its codes are 0: the code path adds its centre whatever the code, so every
     kernel that handles coded channels handles the centring too, and every dimension stays a power of two for the
     GPU kernel. (Before the centre, an fp8 channel with a large mean, as keys with biases have, lost its spread to
     fp8's relative precision: 3-73% rms error of the spread at an offset of 30 standard deviations.)
  4. x'_hat[:, j] = cb[j, code_j] + (j < O ? outl_j · s_j : 0);  x_hat = x'_hat @ Uᵀ.

Storage layout (shared with `pallas_kernels/oskvp_decode_attention.py`):
  codes uint8 [T, H/4]: the low two bits of every channel's code, PLANAR-packed 4 per byte: with Q = H/4, byte i holds
    channels i, i+Q, i+2Q, i+3Q at bit offsets 0, 2, 4, 6.
  hi uint8 [T, H/8] (bits=3 only): the third code bit as a planar bit plane: with P = H/8, byte i holds channels
    i + m·P at bit m, m = 0..7. A 3-bit code is `lo | hi << 2`. None for bits=2.
  outl float8_e4m3fn [T, O]; scale f32 [O]; codebook f32 [H, L]; u f32 [H, H].

Degenerate calibration data (see `fit`): non-finite rows are left out of the statistics (and `calibrate` raises
ValueError for them); with fewer than `min_samples` (default H) usable rows U falls back to the permutation that sorts
the channels by variance (still orthogonal, no eigenvectors estimated from a rank-deficient covariance) and the
codebooks stay at the Gaussian-optimal levels of the (floored) channel std, without Lloyd iterations; constant
channels get a std floor so no level collapses to a NaN; a flat head (all rows equal, e.g. all zero) takes the same
fallback with equally spaced levels that include its value and a spread borrowed from `ref_rms`. All of it is
traceable (per-sequence fitting at prefill).
Shapes: T tokens, N calibration rows, H head dim, O outlier channels, L levels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from moe_jax.kv_quant.lloyd import UNIFORM_Z, fit_levels, lloyd_max, uniform_lloyd  # noqa: F401 (oskvp.lloyd_max)

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
# Scale headroom for the fp8 outlier channels: tokens decoded after prefill may exceed the prefill's amax. e4m3 is a
# float format, so 2x headroom costs no relative precision (only the rarely used subnormal range).
HEADROOM = 2.0
# With too few prefill rows to fit (the short-prompt fallback), the outlier channels' fp8 range reaches at least this
# many times the rows' root-mean-square magnitude (outlier channels run several times the others).
FALLBACK_OUTLIER_RANGE = 16.0
DEFAULT_LLOYD_ITERS = 16
# Gaussian-optimal (Lloyd-Max, Max 1960) reconstruction levels for a unit normal.
GAUSSIAN_LEVELS = {
    2: (-0.7979, 0.7979),
    4: (-1.5104, -0.4528, 0.4528, 1.5104),
    8: (-2.1520, -1.3440, -0.7560, -0.2451, 0.2451, 0.7560, 1.3440, 2.1520),
}


def n_outliers(head_dim: int, outlier_fraction: float) -> int:
  """O = max(8, round(outlier_fraction·H / 8)·8), capped at H: a multiple of 8 that suits the kernel's tiles."""
  return min(head_dim, max(8, int(round(outlier_fraction * head_dim / 8)) * 8))


def check_head_dim(head_dim: int, bits: int, outlier_fraction: float) -> None:
  """Raises ValueError for shapes the storage layout does not support."""
  if bits not in (2, 3):
    raise ValueError(f"bits={bits} must be 2 or 3")
  if head_dim % 8 or head_dim < 8:
    raise ValueError(f"head_dim={head_dim} must be a positive multiple of 8 (planar 2-bit and 1-bit planes)")
  if not 0.0 <= outlier_fraction < 1.0:
    raise ValueError(f"outlier_fraction={outlier_fraction} must be in [0, 1)")


# ---------------------------------------------------------------------------------------------- packing


def pack2(codes: jax.Array) -> jax.Array:
  """uint8 [..., H] with values < 4 -> uint8 [..., H/4], planar: byte i = c[i] | c[i+Q]<<2 | c[i+2Q]<<4 | c[i+3Q]<<6."""
  h = codes.shape[-1]
  c = (codes.astype(jnp.uint8) & 3).reshape(*codes.shape[:-1], 4, h // 4)
  return c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)


def unpack2(packed: jax.Array) -> jax.Array:
  """Inverse of `pack2`: uint8 [..., H/4] -> uint8 [..., H]."""
  q = packed.shape[-1]
  shifts = jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]  # [4, 1]
  c = (packed[..., None, :] >> shifts) & 3  # [..., 4, Q]
  return c.reshape(*packed.shape[:-1], 4 * q)


def pack1(bits: jax.Array) -> jax.Array:
  """uint8 [..., H] of 0/1 -> uint8 [..., H/8], planar: byte i holds channel i + m·(H/8) at bit m."""
  h = bits.shape[-1]
  b = (bits.astype(jnp.uint8) & 1).reshape(*bits.shape[:-1], 8, h // 8)
  shifts = jnp.arange(8, dtype=jnp.uint8)[:, None]
  b = b << shifts
  out = b[..., 0, :]
  for m in range(1, 8):
    out = out | b[..., m, :]
  return out


def unpack1(packed: jax.Array) -> jax.Array:
  """Inverse of `pack1`: uint8 [..., H/8] -> uint8 [..., H]."""
  p = packed.shape[-1]
  shifts = jnp.arange(8, dtype=jnp.uint8)[:, None]
  return ((packed[..., None, :] >> shifts) & 1).reshape(*packed.shape[:-1], 8 * p)


# ---------------------------------------------------------------------------------------------- containers


@struct.dataclass
class OSKVPParams:
  """Per-head calibration. u f32 [H, H] (orthogonal), scale f32 [O], codebook f32 [H, L] (rows < O constant: the
  outlier channels' centres; zero rows, as older calibrations have, store them uncentred)."""

  u: jax.Array
  scale: jax.Array
  codebook: jax.Array

  @property
  def n_outlier(self) -> int:
    return self.scale.shape[-1]

  @property
  def bits(self) -> int:
    return int(np.log2(self.codebook.shape[-1]))


@struct.dataclass
class OSKVPCode:
  """Quantized tokens. codes uint8 [T, H/4]; outl float8_e4m3fn [T, O]; hi uint8 [T, H/8] for bits=3, else None."""

  codes: jax.Array
  outl: jax.Array
  hi: jax.Array | None = None


# ---------------------------------------------------------------------------------------------- fitting


# The optimal uniform 4-level quantizer of a unit Gaussian: step 0.9957 (levels ±0.498, ±1.494; MSE 0.1188 against
# Lloyd-Max's 0.1175).
GAUSSIAN_UNIFORM_STEP = 0.9957

def _sign_fix(u: jax.Array) -> jax.Array:
  """Makes each column's largest-magnitude entry positive, so the basis is deterministic."""
  idx = jnp.argmax(jnp.abs(u), axis=0)
  sign = jnp.sign(u[idx, jnp.arange(u.shape[1])])
  return u * jnp.where(sign == 0, 1.0, sign)[None, :]


def _moments(x: jax.Array, w: jax.Array | None) -> tuple[jax.Array, ...]:
  """x [N, H], w [N] or None -> (x f32 with non-finite rows zeroed, w with them 0, count, normalized weights,
  mean [H], cov f32 [H, H] symmetric): the statistics `fit` starts from."""
  x = x.astype(jnp.float32)
  w = jnp.ones((x.shape[0],), jnp.float32) if w is None else w.astype(jnp.float32)
  finite = jnp.all(jnp.isfinite(x), axis=-1)
  w = jnp.where(finite & jnp.isfinite(w) & (w > 0), w, 0.0)  # a NaN, inf or negative weight leaves its row out
  x = jnp.where(finite[:, None], x, 0.0)
  count = jnp.sum(w)
  wn = w / jnp.maximum(count, 1e-30)
  mean = wn @ x  # [H]
  xc = (x - mean) * (w > 0)[:, None]
  cov = jnp.einsum("NH,NJ->HJ", xc * wn[:, None], xc)
  return x, w, count, wn, mean, 0.5 * (cov + cov.T)


def covariance(x: jax.Array, w: jax.Array | None = None) -> jax.Array:
  """x [N, H] samples, w f32 [N] row weights or None -> f32 [H, H], the weighted covariance whose eigenvectors `fit`
  takes as U (non-finite rows left out). For a caller that diagonalises many heads' covariances in one batched
  `jnp.linalg.eigh` and passes each head's eigenvectors to `fit(evecs=...)`."""
  return _moments(x, w)[-1]


@functools.partial(jax.jit, static_argnames=("n_outlier", "bits", "n_iters", "min_samples", "symmetric", "uniform",
                                             "centred", "lloyd_implementation", "lloyd_interpret"))
def fit(x: jax.Array, w: jax.Array | None = None, *, n_outlier: int, bits: int = 2,
        n_iters: int = DEFAULT_LLOYD_ITERS, min_samples: int | None = None, symmetric: bool = False,
        uniform: bool = False, ref_rms: jax.Array | None = None, centred: bool = True,
        evecs: jax.Array | None = None, lloyd_implementation: str = "xla",
        lloyd_interpret: bool | None = None) -> OSKVPParams:
  """Traceable calibration of one head (used per sequence at prefill, through vmap).

  Args:
    x: [N, H] samples (any float dtype). w: f32 [N] row weights (1 valid, 0 padding); default all ones.
    n_outlier: O. bits: 2 or 3. n_iters: Lloyd-Max iterations.
    min_samples: fewer usable rows than this (default H) -> permutation U and Gaussian-level codebooks (no Lloyd).
    symmetric: fit codebooks symmetric about each channel's mean, levels mean -+ (a, b, ...): Lloyd-Max with L/2
      levels on |x' - mean|. For 2 bits this makes cb0 + cb3 = cb1 + cb2, so the bit-plane decode kernel needs two
      plane types instead of three; for 3 bits four instead of seven (`symmetric_codebooks`). Costs some fidelity on
      skewed channels.
    uniform: fit equally spaced 2-bit codebooks, levels centre + step·(-1.5, -0.5, 0.5, 1.5) (`uniform_lloyd`):
      cb[c] = cb0 + step·c, so a decode kernel can use the codes themselves as the int8 tensor-core operand (one
      plane type). Uniform codebooks are also symmetric. Within 1.1% of Lloyd-Max's error on Gaussian channels.
    ref_rms: f32 scalar, the least magnitude to assume for a flat x (two or more usable rows, all equal: constant
      tokens, or any number of all-zero rows: a head of a zero-initialised or pruned projection), whose rows give
      no spread. `OSKVPMode.fit` passes the root-mean-square magnitude of the sequence's heads; without it a flat x
      takes its rows' own rms, or 1 for an all-zero x (static calibration).
    centred: store the outlier channels about their means (the codebook's outlier rows hold them); False keeps
      them uncentred, as calibrations before the centre were (for comparisons).
    evecs: f32 [H, H], the eigenvectors of `covariance(x, w)` in ascending eigenvalue order (`jnp.linalg.eigh`'s
      second output), when the caller computed them batched with other heads'; None: computed here. On the GPU an
      eigh call costs about the same for 8 heads as for 128 (~1 ms at H = 128; results/oskvp_refit_parts_*), so
      `OSKVPMode.fit_keys_values` makes one call for a layer's keys and values.
    lloyd_implementation: the codebook iterations, "xla" (on sorted samples, `lloyd.lloyd_max`) or "pallas" (one
      Triton kernel, `pallas_kernels/lloyd_max.py`): `lloyd.fit_levels`.
    lloyd_interpret: run the kernel in Pallas's interpreter; None: off the GPU, decided while tracing. A caller
      that decides it before this jitted function (as `OSKVPMode` does) keeps it in the jit cache's key, so a trace
      under another backend (a test's patch) cannot be reused by a real call.

  Returns:
    OSKVPParams with finite entries for any input: non-finite rows are dropped from the statistics. A flat x gets
    the permutation U and equally spaced levels mean + d·(1 - L/2, ..., L/2) (so the rows themselves are coded
    exactly; 0 is a level for an all-zero head) with d = max(rms of the rows, ref_rms) times the Gaussian levels'
    spacing, and the short-prompt fp8 range (before: levels ~1e-10 apart and fp8 scales ~1e-33, so every later,
    non-zero token was stored as ~0).
  """
  h = x.shape[1]
  n_levels = 2**bits
  if uniform and n_levels != len(UNIFORM_Z):
    raise ValueError(f"uniform=True needs bits=2 (got bits={bits})")
  min_samples = h if min_samples is None else min_samples
  x, w, count, wn, mean, cov = _moments(x, w)
  if evecs is None:
    _, evecs = jnp.linalg.eigh(cov)  # ascending eigenvalues
  elif evecs.shape != (h, h):
    raise ValueError(f"evecs has shape {evecs.shape}, expected ({h}, {h}) for x of shape {x.shape}")
  u_eig = _sign_fix(evecs[:, ::-1])
  perm = jnp.argsort(-jnp.diag(cov), stable=True)
  u_perm = jnp.eye(h, dtype=jnp.float32)[:, perm]
  # No spread at all (to float rounding of the mean): nothing to fit a basis or levels to, however many rows. A single
  # non-zero row keeps the short-prompt fallback below (Gaussian levels of its magnitude code later rows better).
  sq_mean = jnp.sum(mean * mean)
  flat = (jnp.trace(cov) <= 1e-10 * sq_mean) & ((count > 1.5) | (sq_mean == 0))
  enough = (count >= min_samples) & ~flat
  u = jnp.where(enough & jnp.all(jnp.isfinite(u_eig)), u_eig, u_perm)

  xr = x @ u  # [N, H]
  mean_r = mean @ u
  var_r = wn @ ((xr - mean_r) ** 2 * (w > 0)[:, None])
  std_r = jnp.sqrt(jnp.maximum(var_r, 1e-6 * jnp.mean(var_r) + 1e-20))
  # Too few rows (a prompt of a few tokens) say little about the spread of later tokens: the fallback gives every
  # channel at least the rows' overall root-mean-square magnitude (before: a spread of ~0, so every later token was
  # coded to one value per channel). Their magnitude, not their spread about the means: on tiny-trained that spread
  # (pooled over the channels) gave +1.99% bits per byte at 2-token prompts against the magnitude's +1.64% (+1.68
  # against +1.56% at 16); a head with a large bias pays for it (README, "known weakness").
  rms = jnp.sqrt(jnp.mean(wn @ (xr * xr)) + 1e-30)
  std_r = jnp.where(enough, std_r, jnp.maximum(std_r, rms))
  # The starting levels, also the short-prompt fallback: the Gaussian optimum of the codebook's family (equally
  # spaced for uniform, so that a fallback codebook keeps the form the Mosaic GPU core relies on).
  g = jnp.asarray(GAUSSIAN_LEVELS[n_levels], jnp.float32)
  if uniform:
    g = GAUSSIAN_UNIFORM_STEP * jnp.asarray(UNIFORM_Z, jnp.float32)
  init = mean_r[:, None] + std_r[:, None] * g[None, :]  # [H, L]
  levels_of = functools.partial(fit_levels, n_iters=n_iters, implementation=lloyd_implementation,
                                interpret=lloyd_interpret)
  if uniform:
    levels = levels_of(xr, w, init, uniform=True)
  elif symmetric:  # the optimal symmetric quantizer: Lloyd-Max on the folded deviations, mirrored
    half = levels_of(jnp.abs(xr - mean_r), w, init[:, n_levels // 2:] - mean_r[:, None])
    levels = mean_r[:, None] + jnp.concatenate([-half[:, ::-1], half], axis=-1)
  else:
    levels = levels_of(xr, w, init)
  levels = jnp.where(enough, levels, init)
  ref = jnp.maximum(jnp.sqrt(jnp.mean(wn @ (xr * xr))), 0.0 if ref_rms is None else jnp.asarray(ref_rms, jnp.float32))
  ref = jnp.where(ref > 0, ref, 1.0)  # an all-zero head with no reference: magnitude 1
  spacing = ref * (g[-1] - g[0]) / (n_levels - 1)
  grid = mean_r[:, None] + spacing * (jnp.arange(n_levels, dtype=jnp.float32) + 1 - n_levels // 2)[None, :]
  levels = jnp.where(flat, grid, levels)
  centre_row = mean_r if centred else jnp.zeros_like(mean_r)
  codebook = jnp.where((jnp.arange(h) < n_outlier)[:, None], centre_row[:, None], levels)  # outlier rows: the centre
  centre = centre_row[:n_outlier]  # [O]

  # fp8 holds deviations from the centre m, over m ± HEADROOM·amax, and that range still holds the uncentred
  # one, ±HEADROOM·amax|x'|: amax ≥ amax|x'| + |m| / HEADROOM, so tokens that drift from the prefill's centre (keys
  # on a RoPE pair that turns during decode) are clipped no sooner than before. Such a token gets fp8's 2^-4 of its
  # deviation, which on the far side of zero is more than its magnitude (up to 2x the uncentred error there).
  # e4m3 being a float format, the wide range costs no relative precision above its subnormals (2^-6 of the scale).
  valid = (w > 0)[:, None]
  dev_max = jnp.max(jnp.abs(xr[:, :n_outlier] - centre) * valid, axis=0, initial=0.0)  # [O]
  abs_max = jnp.max(jnp.abs(xr[:, :n_outlier]) * valid, axis=0, initial=0.0)
  amax = jnp.maximum(dev_max, abs_max + jnp.abs(centre) / HEADROOM)
  floor = 1e-6 * jnp.max(amax, initial=0.0) + 1e-30
  floor = jnp.where(enough, floor, jnp.maximum(floor, FALLBACK_OUTLIER_RANGE * jnp.where(flat, ref, rms)))
  scale = jnp.maximum(amax * HEADROOM, floor) / FP8_MAX
  return OSKVPParams(u=u, scale=scale, codebook=codebook)


def placeholder(head_dim: int, n_outlier: int, *, bits: int = 2, uniform: bool = False) -> OSKVPParams:
  """Parameters that code nothing yet: identity U, unit fp8 scales, unit-Gaussian levels (equally spaced for
  uniform) about 0 and zero outlier centres. For a cache whose stored tokens are all in its exact window until a
  later fit replaces them (`OSKVPMode.refit_at_first_flush`); any kernel reads them as a valid calibration."""
  g = GAUSSIAN_UNIFORM_STEP * np.asarray(UNIFORM_Z) if uniform else np.asarray(GAUSSIAN_LEVELS[2**bits])
  codebook = np.where((np.arange(head_dim) < n_outlier)[:, None], 0.0, g[None, :])
  return OSKVPParams(u=jnp.eye(head_dim, dtype=jnp.float32), scale=jnp.ones((n_outlier,), jnp.float32),
                     codebook=jnp.asarray(codebook, jnp.float32))


def symmetric_codebooks(codebook: jax.Array, rtol: float = 1e-5) -> bool:
  """True if every row [..., H, L] (L = 4 or 8) is symmetric about one centre, cb[c] + cb[L-1-c] the same for every c
  (to rtol of its range): for 4 levels cb0 + cb3 = cb1 + cb2, two plane types in the bit-plane kernel instead of
  three; for 8, four instead of seven."""
  cb = np.asarray(codebook, np.float64)
  levels = cb.shape[-1]
  if levels not in (4, 8):
    return False
  pair_sums = cb + cb[..., ::-1]  # [..., H, L]
  gap = np.abs(pair_sums - pair_sums[..., :1]).max(axis=-1)
  return bool(np.all(gap <= rtol * (np.abs(cb).max(axis=-1) + 1e-30)))


def calibrate(x: jax.Array, *, outlier_fraction: float = 0.08, bits: int = 2, weights: jax.Array | None = None,
              n_iters: int = DEFAULT_LLOYD_ITERS, min_samples: int | None = None,
              symmetric: bool = False, uniform: bool = False) -> OSKVPParams:
  """Fits U, the fp8 scales and the codebooks of one head on x (host-side entry point, validates its input).

  Args:
    x: f32 [N, H] calibration keys (post-RoPE) or values.
    outlier_fraction: fraction of channels kept in fp8 (rounded by `n_outliers`).
    bits: 2 (4 levels) or 3 (8 levels).
    weights: optional f32 [N], finite and >= 0; 0 for rows to ignore (padding).
    symmetric: codebooks symmetric about each channel's mean (see `fit`).
    uniform: equally spaced codebooks (see `fit`).

  Returns:
    OSKVPParams.

  Raises:
    ValueError: bad shape, unsupported head_dim/bits, or non-finite values in x (drop them first; inside jit `fit`
      leaves such rows out instead).
  """
  if x.ndim != 2:
    raise ValueError(f"calibrate expects x of shape [N, H], got {x.shape}")
  check_head_dim(x.shape[1], bits, outlier_fraction)
  if x.shape[0] < 1:
    raise ValueError("calibrate needs at least one row of x")
  if not isinstance(x, jax.core.Tracer):
    bad = ~np.isfinite(np.asarray(x, np.float32))
    if bad.any():
      row, col = np.argwhere(bad)[0]
      raise ValueError(f"calibration data has {int(bad.sum())} non-finite values (first at x[{row}, {col}]); "
                       "drop those rows or pass weights=0 for them")
  if weights is not None:
    if np.shape(weights) != x.shape[:1]:
      raise ValueError(f"weights must have shape [N] = {x.shape[:1]} (one per row of x), got {np.shape(weights)}")
    if not isinstance(weights, jax.core.Tracer):
      w = np.asarray(weights, np.float32)
      bad = ~(np.isfinite(w) & (w >= 0))
      if bad.any():
        first = int(np.argmax(bad))
        raise ValueError(f"weights must be finite and >= 0 (0 leaves a row out), got weights[{first}]={w[first]}")
  return fit(x, weights, n_outlier=n_outliers(x.shape[1], outlier_fraction), bits=bits, n_iters=n_iters,
             min_samples=min_samples, symmetric=symmetric, uniform=uniform)


# ---------------------------------------------------------------------------------------------- (de)quantization


def quantize_rotated(xr: jax.Array, codebook: jax.Array, scale: jax.Array) -> OSKVPCode:
  """Quantizes rotated tokens xr f32 [T, H] with codebook [H, L] and fp8 scale [O] -> OSKVPCode (the outlier
  channels relative to their centres, codebook[:O, 0])."""
  h, n_levels = codebook.shape
  o = scale.shape[-1]
  xr = xr.astype(jnp.float32)
  thr = 0.5 * (codebook[:, 1:] + codebook[:, :-1])  # [H, L-1]
  idx = jnp.sum(xr[:, :, None] > thr[None], axis=-1).astype(jnp.uint8)  # [T, H]
  idx = jnp.where(jnp.arange(h) < o, jnp.uint8(0), idx)
  outl = jnp.clip((xr[:, :o] - codebook[:o, 0]) / scale, -FP8_MAX, FP8_MAX).astype(FP8)
  hi = pack1(idx >> 2) if n_levels == 8 else None
  return OSKVPCode(codes=pack2(idx), outl=outl, hi=hi)


def unpack_codes(code: OSKVPCode) -> jax.Array:
  """uint8 [..., H] level indices from the packed planes."""
  idx = unpack2(code.codes)
  if code.hi is not None:
    idx = idx | (unpack1(code.hi) << 2)
  return idx


def dequantize_rotated(code: OSKVPCode, codebook: jax.Array, scale: jax.Array) -> jax.Array:
  """OSKVPCode [T, ...] -> x'_hat f32 [T, H] in the rotated basis."""
  idx = unpack_codes(code).astype(jnp.int32)  # [T, H]
  xr = jnp.take_along_axis(codebook, idx.T, axis=1).T  # [T, H]
  o = scale.shape[-1]
  outl = code.outl.astype(jnp.float32) * scale
  return xr.at[:, :o].add(outl)


@jax.jit
def quantize(x: jax.Array, params: OSKVPParams) -> OSKVPCode:
  """x [T, H] (original basis) -> OSKVPCode. Batched use: `jax.vmap(quantize)`."""
  return quantize_rotated(x.astype(jnp.float32) @ params.u, params.codebook, params.scale)


@jax.jit
def dequantize(code: OSKVPCode, params: OSKVPParams) -> jax.Array:
  """OSKVPCode -> f32 [T, H] in the original basis (x'_hat @ Uᵀ)."""
  return dequantize_rotated(code, params.codebook, params.scale) @ params.u.T


def storage_bytes(code: OSKVPCode, params: OSKVPParams, *, include_params: bool = True) -> int:
  """Bytes of the stored representation: codes, bit plane, fp8 outliers, and (optionally) U, scales and codebook."""
  total = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(code))
  if include_params:
    total += sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(params))
  return total
