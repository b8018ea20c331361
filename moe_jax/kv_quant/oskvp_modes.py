"""The modes that build OS-KVP layer caches (`oskvp_cache.OSKVPLayerCache`) from a prefill: `OSKVPMode` fits U,
codebooks and fp8 scales per sequence and kv head (`kv_cache="oskvp"` and its variants; all layers' fits batched,
`from_prefill_layers`), `StaticOSKVPMode` copies a per-(layer, kv head) calibration (`kv_cache="oskvp_static"`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import backend
from moe_jax.kv_quant import lloyd, oskvp
from moe_jax.kv_quant.oskvp_cache import OSKVPLayerCache, build_layer_cache, value_layout_for
from moe_jax.layers import rope


@dataclasses.dataclass(frozen=True)
class OSKVPMode:
  """Dynamic OS-KVP: U and codebooks fitted per sequence and kv head on the prefill.

  Attributes:
    bits: 2 or 3 code bits per channel (the values', and the keys' unless key_bits says otherwise).
    key_bits: the keys' code bits, 2 or 3, where they differ from `bits` (None: `bits`). Keys carry most of the
      2-bit cost (`benchmarks/oskvp_bits_split.py`), so `key_bits=3` with 2-bit values ("oskvp_k3v2") spends the
      third bit where it pays. 3-bit keys decode through the Pallas kernel where `supports_key_high_bits` (head dim
      128 or 256, G a power of two <= 8; 1.65x the 2-bit kernel's time at 64k x 8 on the H200), 3-bit values and
      other shapes through the XLA reference.
    outlier_fraction: fraction of the rotated channels kept in fp8 (rounded by `oskvp.n_outliers`).
    window: R, tokens kept in the bf16 residual window.
    n_iters: Lloyd-Max iterations.
    max_fit_tokens: prompts longer than this are fitted on that many evenly spaced tokens of each sequence (bounds
      the prefill's fitting memory, a few [n·B, K, H, max_fit_tokens] float32 arrays for a fit of n layers, see
      `prefill_fit_chunk`, at long context).
    rope_theta, rope_shifts: RoPE-shift augmentation of the key calibration. Keys are post-RoPE, so a key written
      at a later position is the same pre-RoPE vector rotated further in each channel pair (j, j + H/2): a basis and
      codebooks fitted on prefill positions alone misfit decoded tokens (measured on tiny-trained: key error 0.47
      instead of 0.23 on positions 256-511 when fitted on 0-255). The keys are therefore fitted on `rope_shifts`
      copies of the prefill keys rotated by position shifts m·cache_len/rope_shifts (m = 0..rope_shifts-1) with
      RoPE base `rope_theta` (0.26 in-sample, 0.26 on later positions). `prefill` sets it to the model's base
      through `for_config`; a bare mode uses 1e4 (the built-in configs). None disables it.
    implementation: decode attention: "auto" (Pallas on GPU, XLA elsewhere), "pallas" or "xla".
    symmetric: codebooks symmetric about each channel's mean (`oskvp.fit`): the bit-plane kernel then needs two
      plane types per side instead of three (2-bit codes), four instead of seven for 3-bit keys ("oskvp_k3v2_sym");
      fidelity cost in benchmarks/results/kv_cache.md.
    uniform: equally spaced 2-bit codebooks (`oskvp.fit(uniform=True)`): the codes themselves are the int8
      tensor-core operand of the fused Mosaic GPU cores (`pallas_kernels/oskvp_decode_core_mma.py`,
      `oskvp_decode_core_mgpu.py`; `oskvp_uniform_codes.resolved_core`), which decode
      attention uses on the GPU where it applies (`oskvp_uniform_codes.mosaic_tiling`; the cache then stores its
      values as those cores stream them, `block_major_values`); elsewhere the Triton kernel (two plane types:
      uniform codebooks are symmetric) or the XLA reference over the token-major view. Fidelity in
      benchmarks/results/kv_cache.md.
    refit_at_first_flush: a sequence whose prompt is shorter than the window (nothing coded at prefill) is fitted
      when its window is first full, on those R tokens, so its codes come from a fit on R tokens, the coded ones
      among them, instead of one on the prompt alone (a prompt shorter than H falls back to a permutation basis and
      levels as wide as its magnitude). A prefill whose prompts are all shorter than R fits nothing then
      (`oskvp.placeholder`), so each such row is fitted once. Costs a fit of the row in every layer inside that
      decode step (all layers in one fit with `refit_across_layers`); measured in the README's OS-KVP section. A
      serving engine clears the flag of its free slots (`moe_jax.serving.steps.decode_slots`), which step too.
    refit_chunk: how many rows one batched fit refits at a flush (`oskvp_cache._refit_in_chunks`): refit_chunk rows
      of one layer (`OSKVPLayerCache._refit_first_flushes`), max(1, refit_chunk // L) rows of L layers fitted
      together (`refit_across_layers`). While `oskvp_cache.refit_chunk_min_rows` or more rows are left, that many
      (or fewer, padded) are fitted together, the rest one at a time. A fit's eigh call costs about the same for 1
      row as for 8 on the GPU, and a fit pays for its padding rows too, so chunks pay off for bursts of rows (many
      prompts admitted at once), single fits for the lone row of continuous batching. 1: always one row at a time.
    refit_across_layers: the model's decode step refits all its layers' flushing rows together before its first
      layer runs (`oskvp_cache.refit_before_step`: one batched fit per chunk of rows for all layers), instead of one
      fit per layer inside each layer's flush: one fit of a row in 48 layers (+12.6 ms a step on an H100 with the Lloyd
      kernel; +23 with one-hot Lloyd scans) costs far less than 48 one-layer fits (+71 ms a step, one-hot). The same
      fits either way; False keeps the per-layer refit (for comparison).
    block_major_values: a uniform cache whose capacity is a multiple of 128 stores its value codes and outliers
      block-major ([B, K, S/128, X, 128]: each 128-token block's rows contiguous, `oskvp_cache.value_layout_for`),
      else tokens contiguous ([B, K, X, S]). The Mosaic GPU cores take either; the same bytes. On an H100 their TMA
      ring alone took 2.4–3.0% less time with block-major values (results/oskvp_stream_layout_h100_s49.md).
    fit_implementation: the codebooks' Lloyd iterations at prefill and refit (`oskvp.fit`'s lloyd_implementation):
      "auto" (on the GPU the Pallas kernel unless few heads have many samples, `lloyd.auto_implementation`; XLA
      elsewhere), "pallas" or "xla".
    prefill_across_layers: a model's prefill fits all its layers' caches in a few batched fits
      (`from_prefill_layers`) instead of one fit per layer: on the GPU a fit costs about the same for one sequence's
      kv heads as for many (an eigh call, the Lloyd iterations' launches), and the layers' fits are independent (all
      keys and values are known when the prefill's last layer has run). The same fits either way at a given
      Lloyd implementation (bit for bit on the CPU); with `fit_implementation="auto"` on the GPU a batched fit has
      more heads, so it may take the Pallas kernel where one layer's fit took the XLA form (`lloyd.auto_implementation`;
      the two agree to ~1e-3 of a channel's spread, at the same error).
    prefill_fit_chunk: (layer, sequence) pairs per batched prefill fit: max(1, prefill_fit_chunk // B) layers go
      into one fit, so a fit holds at most max(B, prefill_fit_chunk) pairs (see `max_fit_tokens`). A GPU compile
      reuses one layer's fit buffers for the next, so batching costs memory there: 48 layers, 4096-token prompts,
      K = 8, H = 128 (H100, results/oskvp_prefill_fit_h100_s40.md): temporaries 3128 MiB against 2233 for one
      prompt, 16391 against 11609 for eight (2 layers a fit), for 4.0x and 1.28x less time. The CPU compile keeps
      every layer's buffers either way (3144 against 3110 MiB at 16 layers).
  """

  bits: int = 2
  key_bits: int | None = None
  outlier_fraction: float = 0.08
  window: int = 128
  n_iters: int = oskvp.DEFAULT_LLOYD_ITERS
  max_fit_tokens: int = 4096
  rope_theta: float | None = 1e4
  rope_shifts: int = 8
  implementation: str = "auto"
  symmetric: bool = False
  uniform: bool = False
  block_major_values: bool = True
  refit_at_first_flush: bool = True
  refit_chunk: int = 8
  refit_across_layers: bool = True
  fit_implementation: str = "auto"
  prefill_across_layers: bool = True
  prefill_fit_chunk: int = 16

  def __post_init__(self):
    if self.bits not in (2, 3):
      raise ValueError(f"bits={self.bits} must be 2 or 3")
    if self.key_bits not in (None, 2, 3):
      raise ValueError(f"key_bits={self.key_bits} must be None, 2 or 3")
    if self.symmetric and self.bits != 2:
      raise ValueError(f"symmetric=True needs bits=2 (got bits={self.bits}): the kernel reads 2-bit values only "
                       "(3-bit keys: key_bits=3)")
    if self.uniform and (self.bits != 2 or self.symmetric):
      raise ValueError(f"uniform=True needs bits=2 and symmetric=False (got bits={self.bits}, "
                       f"symmetric={self.symmetric}): uniform codebooks are already symmetric")
    if self.uniform and self.k_bits != 2:
      raise ValueError(f"uniform codebooks need 2-bit keys (got key_bits={self.key_bits})")
    if self.window < 1:
      raise ValueError(f"window={self.window} must be >= 1")
    if not 0 <= self.outlier_fraction < 1:
      raise ValueError(f"outlier_fraction={self.outlier_fraction} must be in [0, 1)")
    if self.max_fit_tokens < 1:
      raise ValueError(f"max_fit_tokens={self.max_fit_tokens} must be >= 1")
    if not isinstance(self.n_iters, int) or isinstance(self.n_iters, bool) or self.n_iters < 0:
      raise ValueError(f"n_iters={self.n_iters!r} must be an int >= 0 (Lloyd-Max iterations)")
    if self.rope_shifts < 1:
      raise ValueError(f"rope_shifts={self.rope_shifts} must be >= 1")
    if self.refit_chunk < 1:
      raise ValueError(f"refit_chunk={self.refit_chunk} must be >= 1")
    if self.prefill_fit_chunk < 1:
      raise ValueError(f"prefill_fit_chunk={self.prefill_fit_chunk} must be >= 1")
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation={self.implementation!r} must be 'auto', 'pallas' or 'xla'")
    if self.fit_implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"fit_implementation={self.fit_implementation!r} must be 'auto', 'pallas' or 'xla'")

  @property
  def k_bits(self) -> int:
    """The keys' code bits."""
    return self.bits if self.key_bits is None else self.key_bits

  def for_config(self, config) -> "OSKVPMode":
    """The same mode fitting keys at `config.rope_theta` (a no-op when augmentation is disabled)."""
    if self.rope_theta is None or self.rope_theta == config.rope_theta:
      return self
    return dataclasses.replace(self, rope_theta=float(config.rope_theta))

  def _shifts(self, rope_span: int) -> int:
    """The RoPE-shifted copies of each key fitted on (1: none; values have rope_span 0)."""
    return self.rope_shifts if (rope_span > 0 and self.rope_theta is not None and self.rope_shifts > 1) else 1

  def _fit_tokens(self, x: jax.Array, lengths: jax.Array, rope_span: int) -> tuple[jax.Array, jax.Array]:
    """x [B, T, K, H], lengths [B] -> (x [B, M, K, H], lengths [B]): the tokens fitted, all of them or, past
    max_fit_tokens' share per RoPE shift (M), that many evenly spaced over each sequence's own length (ragged
    batches stay fitted). Selecting again selects nothing more."""
    budget = max(1, self.max_fit_tokens // self._shifts(rope_span))
    if x.shape[1] <= budget:
      return x, lengths
    m, lengths = budget, lengths.astype(jnp.int32)
    ar = jnp.arange(m)[None, :]
    idx = jnp.where(lengths[:, None] <= m, ar, ar * lengths[:, None] // m)  # [B, M]
    return jnp.take_along_axis(x, idx[:, :, None, None], axis=1), jnp.minimum(lengths, m)

  def _fit_inputs(self, x: jax.Array, lengths: jax.Array, rope_span: int) -> tuple[jax.Array, ...]:
    """x [B, T, K, H], lengths [B] -> (samples f32 [B, K, N, H], weights f32 [B, N], ref_rms f32 [B], shifts): what
    `fit` fits each head on (N = T, or max_fit_tokens' share of it, times the RoPE shifts)."""
    shifts = self._shifts(rope_span)
    x, lengths = self._fit_tokens(x, lengths, rope_span)
    b, t, _, _ = x.shape
    w = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)  # [B, T]
    if shifts > 1:
      deltas = [m * rope_span // shifts for m in range(shifts)]
      x = jnp.concatenate([rope(x, jnp.full((b, t), d, jnp.int32), self.rope_theta) for d in deltas], axis=1)
      w = jnp.tile(w, (1, shifts))
    # A flat head (e.g. all zero at prefill) borrows the magnitude of the sequence's other heads for the tokens
    # decoded later (`oskvp.fit`'s ref_rms): root mean square over the valid, finite values of all heads.
    xf = x.astype(jnp.float32)
    ok = jnp.isfinite(xf) & (w[:, :, None, None] > 0)
    ref_rms = jnp.sqrt(jnp.sum(jnp.where(ok, xf * xf, 0.0), axis=(1, 2, 3)) / jnp.maximum(jnp.sum(ok, (1, 2, 3)), 1))
    return jnp.swapaxes(x, 1, 2), w, ref_rms, shifts

  @staticmethod
  def _covariances(xs: jax.Array, w: jax.Array) -> jax.Array:
    """`_fit_inputs`' samples [B, K, N, H] and weights [B, N] -> f32 [B, K, H, H] (`oskvp.covariance` per head)."""
    return jax.vmap(jax.vmap(oskvp.covariance, in_axes=(0, None)))(xs, w)

  def _fit_heads(self, xs: jax.Array, w: jax.Array, ref_rms: jax.Array, shifts: int, bits: int,
                 evecs: jax.Array) -> oskvp.OSKVPParams:
    """`_fit_inputs`' output and the eigenvectors of `_covariances` f32 [B, K, H, H] -> OSKVPParams with leading
    [B, K]."""
    h = xs.shape[-1]
    impl = self.fit_implementation
    if impl == "auto":  # from the heads fitted at once (B x K here; vmap hides them from the kernel's call)
      impl = lloyd.auto_implementation(xs.shape[0] * xs.shape[1], xs.shape[2], h)
    # Decided here, outside oskvp.fit's jit, so that it is part of that cache's key.
    interpret = backend.interpret_kernels() if impl == "pallas" else None
    # The permutation fallback still triggers below H real tokens, however many shifted copies there are.
    fit = lambda xs, ws, ref, ev: oskvp.fit(xs, ws, n_outlier=oskvp.n_outliers(h, self.outlier_fraction),
                                            bits=bits, n_iters=self.n_iters, min_samples=h * shifts,
                                            symmetric=self.symmetric, uniform=self.uniform, ref_rms=ref, evecs=ev,
                                            lloyd_implementation=impl, lloyd_interpret=interpret)
    return jax.vmap(jax.vmap(fit, in_axes=(0, None, None, 0)))(xs, w, ref_rms, evecs)

  def fit(self, x: jax.Array, lengths: jax.Array, *, rope_span: int = 0,
          bits: int | None = None) -> oskvp.OSKVPParams:
    """x [B, T, K, H], lengths [B] -> OSKVPParams with leading [B, K] (padding positions masked), `bits` code bits
    (default `self.bits`; keys are fitted with `k_bits`).

    rope_span > 0 (keys): fit on RoPE-shifted copies covering shifts [0, rope_span) (see the class docstring).
    A head whose prefill tokens are all equal (all zero: a zero-initialised or pruned projection) is fitted with the
    sequence's root-mean-square magnitude over all heads as its spread (`oskvp.fit`'s ref_rms).
    """
    bits = self.bits if bits is None else bits
    oskvp.check_head_dim(x.shape[-1], bits, self.outlier_fraction)
    ins = self._fit_inputs(x, lengths, rope_span)
    return self._fit_heads(*ins, bits, jnp.linalg.eigh(self._covariances(*ins[:2]))[1])

  def fit_keys_values(self, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                      rope_span: int) -> tuple[oskvp.OSKVPParams, oskvp.OSKVPParams]:
    """k, v [B, T, K, H], lengths [B] -> (keys' params, values' params), each leading [B, K]: `fit(k, lengths,
    rope_span=rope_span, bits=k_bits)` and `fit(v, lengths)`, with one batched eigendecomposition of all 2·B·K
    covariances instead of one per side. On the GPU an eigh call costs about the same for 8 heads as for 128 (H100,
    H = 128: 1.04 against 1.54 ms), and it is most of a fit's time (results/oskvp_refit_parts_*)."""
    return self._fit_selected(k, lengths, v, lengths, rope_span)

  def _fit_selected(self, k: jax.Array, k_lengths: jax.Array, v: jax.Array, v_lengths: jax.Array,
                    rope_span: int) -> tuple[oskvp.OSKVPParams, oskvp.OSKVPParams]:
    """`fit_keys_values` with the keys' and values' own lengths (each side's `_fit_tokens` may have selected)."""
    h = k.shape[-1]
    for bits in (self.k_bits, self.bits):
      oskvp.check_head_dim(h, bits, self.outlier_fraction)
    ins_k, ins_v = self._fit_inputs(k, k_lengths, rope_span), self._fit_inputs(v, v_lengths, 0)
    covs = jnp.concatenate([self._covariances(*ins_k[:2]), self._covariances(*ins_v[:2])], axis=1)  # [B, 2K, H, H]
    _, evecs = jnp.linalg.eigh(covs)
    kh = k.shape[2]
    return (self._fit_heads(*ins_k, self.k_bits, evecs[:, :kh]), self._fit_heads(*ins_v, self.bits, evecs[:, kh:]))

  def from_prefill(self, k, v, lengths, cache_len: int, *, layer: int) -> OSKVPLayerCache:
    """k, v: [B, T, K, H] prefill keys (post-RoPE) / values -> OSKVPLayerCache with S = cache_len."""
    del layer
    return self.from_prefill_layers([(k, v)], lengths, cache_len)[0]

  def from_prefill_layers(self, kvs, lengths: jax.Array, cache_len: int) -> tuple[OSKVPLayerCache, ...]:
    """kvs: one (k, v) [B, T, K, H] per layer (keys post-RoPE), lengths int32 [B] -> one OSKVPLayerCache per layer,
    each `from_prefill(k, v, lengths, cache_len)`, with the layers' fits batched (`prefill_across_layers`: one
    `fit_layers` call per chunk of max(1, prefill_fit_chunk // B) layers). Layers of different shapes or dtypes are
    fitted one at a time."""
    kvs = list(kvs)
    if not kvs:
      return ()
    # Strongly typed: `jnp.full((B,), n)` is weakly typed, and so was the refit mask built from it, which the step's
    # `before_step` returns strongly typed (a decode step compiled twice, once for each).
    lengths = jnp.asarray(lengths, jnp.int32)
    same = len({(k.shape, k.dtype, v.shape, v.dtype) for k, v in kvs}) == 1
    b = kvs[0][0].shape[0]
    per_fit = max(1, self.prefill_fit_chunk // max(1, b)) if (self.prefill_across_layers and same) else 1
    fitted = lambda: self._fit_in_groups(kvs, lengths, cache_len, per_fit)  # noqa: E731
    if self.refit_at_first_flush:
      # Prompts shorter than the window are fitted at their first flush; a batch of only those is fitted only then.
      short = lengths < self.window  # n_comp == 0 and n_res < R: the first flush will hold more than the prompt
      params = jax.lax.cond(jnp.all(short), lambda: self._placeholders(kvs), fitted)
    else:
      params = fitted()
    caches = tuple(build_layer_cache(k, v, lengths, cache_len, pk, pv, window=self.window,
                                     implementation=self.implementation, symmetric=self.symmetric or self.uniform,
                                     value_layout=value_layout_for(self.uniform, cache_len, self.block_major_values))
              for (k, v), (pk, pv) in zip(kvs, params))
    if self.refit_at_first_flush:
      caches = tuple(cache.replace(refit=short, refit_mode=self) for cache in caches)
    return caches

  def fit_layers(self, kvs, lengths: jax.Array, *,
                 rope_span: int) -> list[tuple[oskvp.OSKVPParams, oskvp.OSKVPParams]]:
    """kvs: one (k, v) [B, T, K, H] per layer, lengths int32 [B] -> (keys', values' params) with leading [B, K] for
    each layer: `fit_keys_values` of every layer, in one fit. Each layer's fitted tokens are selected (`_fit_tokens`)
    before they are stacked, sequence-major ([B·n, M, K, H], row i·n + j = layer j of sequence i, M <=
    max_fit_tokens), so that a batch sharded over devices stays where it is."""
    b, n = lengths.shape[0], len(kvs)
    ks, vs = ([self._fit_tokens(kv[i], lengths, span) for kv in kvs] for i, span in ((0, rope_span), (1, 0)))
    stack = lambda pairs, i: jnp.stack([p[i] for p in pairs], axis=1).reshape(  # noqa: E731
        b * n, *pairs[0][i].shape[1:])
    pk, pv = self._fit_selected(stack(ks, 0), stack(ks, 1), stack(vs, 0), stack(vs, 1), rope_span)
    part = lambda tree, j: jax.tree_util.tree_map(lambda a: a.reshape(b, n, *a.shape[1:])[:, j], tree)  # noqa: E731
    return [(part(pk, j), part(pv, j)) for j in range(n)]

  def _fit_in_groups(self, kvs, lengths: jax.Array, cache_len: int,
                     per_fit: int) -> list[tuple[oskvp.OSKVPParams, oskvp.OSKVPParams]]:
    """(keys', values' params) with leading [B, K] for each layer of `from_prefill_layers`, `per_fit` layers in one
    `fit_layers` call."""
    n_fits = -(-len(kvs) // per_fit)
    per_fit = -(-len(kvs) // n_fits)  # as even as it gets; a short last group is padded with its last layer (the
    out = []                          # fits then have the same shapes; the padding's are computed and dropped)
    for first in range(0, len(kvs), per_fit):
      group = kvs[first:first + per_fit]
      out += self.fit_layers(group + [group[-1]] * (per_fit - len(group)), lengths, rope_span=cache_len)
    return out[:len(kvs)]

  def _placeholders(self, kvs) -> list[tuple[oskvp.OSKVPParams, oskvp.OSKVPParams]]:
    """`oskvp.placeholder` params (identity U) with leading [B, K] for each layer: a prefill with nothing to fit."""
    def one(x, bits):  # x [B, T, K, H]
      b, _, kh, h = x.shape
      return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (b, kh, *a.shape)),
                                    oskvp.placeholder(h, oskvp.n_outliers(h, self.outlier_fraction), bits=bits,
                                                      uniform=self.uniform))
    return [(one(k, self.k_bits), one(v, self.bits)) for k, v in kvs]


@dataclasses.dataclass(frozen=True, eq=False)
class StaticOSKVPMode:
  """Static OS-KVP: U and codebooks calibrated once per (layer, kv head) (`moe_jax.kv_quant.static`).

  Attributes:
    params_k, params_v: OSKVPParams with leading [n_layers, K], or None before calibration.
    window: R.
    implementation: "auto" (Pallas on GPU, XLA elsewhere), "pallas" or "xla".

  The params are copied into every sequence's cache (the layout keeps every leaf batch-leading); a prompt pays no
  fitting time, and short prompts get codebooks fitted on plenty of data.
  """

  params_k: oskvp.OSKVPParams | None = None
  params_v: oskvp.OSKVPParams | None = None
  window: int = 128
  implementation: str = "auto"

  def __post_init__(self):
    if not isinstance(self.window, int) or self.window < 1:
      raise ValueError(f"window={self.window!r} must be an int >= 1")
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation={self.implementation!r} must be 'auto', 'pallas' or 'xla'")

  def matches(self, config) -> bool:
    """Whether the calibration's [layers, kv heads, head dim] are the model's (True before calibration)."""
    if self.params_k is None:
      return True
    n_layers, k, h = self.params_k.u.shape[0], self.params_k.u.shape[1], self.params_k.u.shape[-1]
    return (n_layers, k, h) == (config.n_layers, config.n_kv_heads, config.head_dim)

  def for_config(self, config) -> "StaticOSKVPMode":
    """This mode, after checking that its calibration is for `config`'s attention shapes (ValueError if not; before,
    another model's calibration crashed inside a dot or, at equal head dims, was used silently)."""
    if not self.matches(config):
      u = self.params_k.u
      raise ValueError(f"kv_cache='oskvp_static' is calibrated for {u.shape[0]} layers x {u.shape[1]} kv heads x "
                       f"head_dim {u.shape[-1]}, the model has {config.n_layers} x {config.n_kv_heads} x "
                       f"{config.head_dim}: calibrate it for this model (moe_jax.cli.setup_kv_cache does)")
    return self

  def from_prefill(self, k, v, lengths, cache_len: int, *, layer: int) -> OSKVPLayerCache:
    if self.params_k is None:
      raise ValueError("kv_cache='oskvp_static' is not calibrated: run moe_jax.kv_quant.static.calibrate_model(model, "
                       "tokens) and static.install(...) (or static.load(path)) first; the command-line tools do it "
                       "(moe_jax.cli.setup_kv_cache)")
    n_layers = self.params_k.u.shape[0]
    if not 0 <= layer < n_layers:
      raise ValueError(f"layer={layer} outside the {n_layers} calibrated layers")
    b = k.shape[0]
    per_seq = lambda p: jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[layer], (b, *a.shape[1:])), p)
    return build_layer_cache(k, v, lengths, cache_len, per_seq(self.params_k), per_seq(self.params_v),
                             window=self.window, implementation=self.implementation)
