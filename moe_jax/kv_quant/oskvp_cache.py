"""The OS-KVP layer cache (`kv_cache="oskvp"`, `"oskvp3"`, `"oskvp_static"`): a compressed store plus a rotated
bf16 residual window, and its refits at the first flush; the modes that build it from the prefill are in
`oskvp_modes.py`.

Layout per layer (every leaf batch-leading, shared with `pallas_kernels/oskvp_decode_attention.py`):
  codes_k, codes_v  uint8 [B, K, S, H/4]     2-bit codes, planar-packed (see `oskvp.pack2`)
  hi_k, hi_v        uint8 [B, K, S, H/8]     third code bit (bits=3 only, else None)
  outl_k, outl_v    float8_e4m3fn [B, K, S, O]
  (`value_layout`, for the Mosaic GPU cores of `OSKVPMode(uniform=True)`: "block_major" codes_v uint8
  [B, K, S/128, H/4, 128] and outl_v [B, K, S/128, O, 128], each 128-token block's value rows contiguous; or
  "token_contiguous" [B, K, H/4, S] and [B, K, O, S]; `value_store` gives the token-major view)
  scale_k, scale_v  f32 [B, K, O]
  cb_k, cb_v        f32 [B, K, H, L]
  u_k, u_v          f32 [B, K, H, H]
  res_k, res_v      bf16 [B, K, R, H]        the most recent tokens, already rotated
  n_comp, n_res     int32 [B]                tokens in the compressed store / in the window
  refit             bool [B]                 refit the row at its first flush (dynamic modes, else None)
A sequence's tokens are compressed [0, n_comp) followed by residual [0, n_res); S = cache_len, enough for any
sequence the cache can hold (n_comp + n_res <= cache_len).

Prefill split: n_comp = R·floor((len - 1) / R) and n_res = len - n_comp, so the window holds 1..R tokens and the
compressed store is block-aligned. Decode (`extend`, T=1 at a time): if the window is full, its R tokens are quantized
with the prefill's U and codebooks (or, for a row flagged `refit`, with ones fitted now on those R tokens; see
`OSKVPMode.refit_at_first_flush`) and written as one block at n_comp (skipped entirely by `lax.cond` when no sequence
of the batch is full); the new token, rotated, goes into the window; then attention runs over both parts.
Keys are post-RoPE (q·k = (qU)·(kU) is exact); values use their own U_v and the output is rotated back once.
Dynamic modes fit U and codebooks per sequence and kv head on the valid prefill tokens (padding masked by length;
short prompts fall back as documented in `oskvp.fit`; keys with RoPE-shift augmentation so that tokens decoded at
later positions still fit, see `OSKVPMode`); the static mode uses per-(layer, kv head) calibration.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from moe_jax import backend
from moe_jax.kv_cache import extend_token_by_token
from moe_jax.kv_quant import oskvp
from moe_jax.kv_quant.oskvp_attention import dequantize_store, oskvp_decode_attention

if TYPE_CHECKING:
  from moe_jax.kv_quant.oskvp_modes import OSKVPMode


VALUE_LAYOUTS = ("token_major", "token_contiguous", "block_major")
VALUE_BLOCK = 128  # tokens per block of "block_major" (`pallas_kernels.oskvp_value_layout.BLOCK`, the cores' step)


def value_layout_for(uniform: bool, cache_len: int, block_major: bool = True) -> str:
  """The value layout of a cache of `cache_len` tokens: token-major unless the codebooks are uniform (the Mosaic GPU
  cores' caches); then block-major where `block_major` and cache_len is a multiple of 128, else tokens contiguous."""
  if not uniform:
    return "token_major"
  return "block_major" if block_major and cache_len % VALUE_BLOCK == 0 else "token_contiguous"


def stored_values(x: jax.Array, layout: str) -> jax.Array:
  """Token-major [B, K, S, X] -> the stored layout (`VALUE_LAYOUTS`; the same bytes, reordered)."""
  if layout == "token_major":
    return x
  if layout == "token_contiguous":
    return jnp.swapaxes(x, -1, -2)
  b, k, s, c = x.shape
  return jnp.swapaxes(x.reshape(b, k, s // VALUE_BLOCK, VALUE_BLOCK, c), -1, -2)


def token_major_values(x: jax.Array, layout: str) -> jax.Array:
  """`stored_values`' inverse: the stored layout -> token-major [B, K, S, X]."""
  if layout == "token_major":
    return x
  if layout == "token_contiguous":
    return jnp.swapaxes(x, -1, -2)
  b, k, n, c, block = x.shape
  return jnp.swapaxes(x, -1, -2).reshape(b, k, n * block, c)


def refit_chunk_min_rows(chunk: int) -> int:
  """The fewest rows left to refit for which a batched fit of `chunk` rows beats one fit per row: a third of the
  chunk, at least 2. Measured on an H100 (B = 8, K = 8, H = 128, R = 128; results/oskvp_refit_cost_*): a fit adds
  ~1.5 ms to the step for 1 row, ~1.7 for 2, ~2.4 for 4 and ~3.9 for 8, so 8 rows break even at ~2.6 single fits."""
  return max(2, -(-chunk // 3))


@struct.dataclass
class OSKVPLayerCache:
  """One layer's OS-KVP cache; fields and shapes in the module docstring."""

  codes_k: jax.Array
  codes_v: jax.Array
  outl_k: jax.Array
  outl_v: jax.Array
  scale_k: jax.Array
  scale_v: jax.Array
  cb_k: jax.Array
  cb_v: jax.Array
  u_k: jax.Array
  u_v: jax.Array
  res_k: jax.Array
  res_v: jax.Array
  n_comp: jax.Array
  n_res: jax.Array
  hi_k: jax.Array | None = None
  hi_v: jax.Array | None = None
  refit: jax.Array | None = None  # bool [B]: refit the row at its first flush (`OSKVPMode.refit_at_first_flush`)
  implementation: str = struct.field(pytree_node=False, default="auto")
  symmetric: bool = struct.field(pytree_node=False, default=False)  # codebooks from `OSKVPMode(symmetric=True)`
  value_layout: str = struct.field(pytree_node=False, default="token_major")  # codes_v, outl_v (`VALUE_LAYOUTS`)
  refit_mode: OSKVPMode | None = struct.field(pytree_node=False, default=None)  # whose `fit` refits (with refit)
  # Set by `refit_before_step` for the step's first token, whose refits it has done (`extend` clears it after).
  refits_done: bool = struct.field(pytree_node=False, default=False)

  @property
  def max_len(self) -> int:
    return self.codes_k.shape[2]

  @property
  def values_for_mosaic(self) -> bool:
    """The values are stored as the Mosaic GPU cores stream them (tokens contiguous or block-major)."""
    return self.value_layout != "token_major"

  @property
  def kv_shape(self) -> tuple[int, int]:
    """(K, H): kv heads and head dim the cache holds."""
    return int(self.res_k.shape[1]), int(self.res_k.shape[3])

  @property
  def window(self) -> int:
    return self.res_k.shape[2]

  def nbytes(self) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self))

  def value_store(self) -> tuple[jax.Array, jax.Array]:
    """(codes_v uint8 [B, K, S, H/4], outl_v [B, K, S, O]) token-major, whatever the stored layout (a transpose of
    the whole store for the Mosaic GPU cores' layouts: for the XLA reference and the Triton kernel)."""
    return (token_major_values(self.codes_v, self.value_layout),
            token_major_values(self.outl_v, self.value_layout))

  @staticmethod
  def before_step(layers: tuple) -> tuple:
    """`KVCache`'s hook for work before a decode step's first layer: `refit_before_step`."""
    return refit_before_step(layers)

  def _window_originals(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """rows int32 [C] -> (keys, values) f32 [C, R, K, H]: those rows' windows in the original basis."""
    original = lambda res, u: jnp.einsum("CKRJ,CKHJ->CRKH", res[rows].astype(jnp.float32), u[rows])  # noqa: E731
    return original(self.res_k, self.u_k), original(self.res_v, self.u_v)

  def _put_refit(self, rows: jax.Array, valid: jax.Array, xk: jax.Array, xv: jax.Array, pk: oskvp.OSKVPParams,
                 pv: oskvp.OSKVPParams) -> "OSKVPLayerCache":
    """Writes the fits pk, pv (leading [C, K]) of rows int32 [C] whose valid bool [C] is set, with their windows xk,
    xv f32 [C, R, K, H] (`_window_originals`) rotated into the new bases; the other rows' writes are dropped."""
    rk, rv = (jnp.einsum("CRKH,CKHJ->CKRJ", x, p.u) for x, p in ((xk, pk), (xv, pv)))
    dst = jnp.where(valid, rows, self.n_res.shape[0])  # out of range -> the write is dropped
    put = lambda a, x: a.at[dst].set(x.astype(a.dtype), mode="drop")  # noqa: E731
    return self.replace(u_k=put(self.u_k, pk.u), cb_k=put(self.cb_k, pk.codebook), scale_k=put(self.scale_k, pk.scale),
                        res_k=put(self.res_k, rk), u_v=put(self.u_v, pv.u), cb_v=put(self.cb_v, pv.codebook),
                        scale_v=put(self.scale_v, pv.scale), res_v=put(self.res_v, rv))

  def _refit_first_flushes(self, full: jax.Array) -> "OSKVPLayerCache":
    """Refits the rows flushing now whose `refit` flag is set and clears the flag of every flushing row, in chunks
    (`_refit_in_chunks`). A step whose caches went through `refit_before_step` has no such row left here."""
    return _refit_in_chunks((self,), full[None] & self.refit[None])[0].replace(refit=self.refit & ~full)

  def _flush(self) -> "OSKVPLayerCache":
    """Moves each full window (n_res == R) into the compressed store at n_comp, as one block of R tokens (after
    refitting the rows flagged `refit`, see `OSKVPMode.refit_at_first_flush`)."""
    b, r = self.n_res.shape[0], self.window
    full = self.n_res == r
    if self.refit is not None and not self.refits_done:
      self = self._refit_first_flushes(full)  # pylint: disable=self-cls-assignment
    quant = jax.vmap(jax.vmap(oskvp.quantize_rotated))  # over B, K
    ck = quant(self.res_k.astype(jnp.float32), self.cb_k, self.scale_k)
    cv = quant(self.res_v.astype(jnp.float32), self.cb_v, self.scale_v)
    pos = jnp.where(full, self.n_comp, self.max_len)  # out of range -> the write is dropped
    rows = jnp.arange(b)[:, None]
    idx = pos[:, None] + jnp.arange(r)[None, :]  # [B, R]

    def put(store, block):  # store [B, K, S, X], block [B, K, R, X]
      return store.at[rows, :, idx].set(jnp.swapaxes(block, 1, 2), mode="drop")

    def put_v(store, block):  # every `value_layout` indexes as [B, R, K, X] (idx past S: dropped)
      if self.value_layout == "token_major":
        return put(store, block)
      if self.value_layout == "token_contiguous":  # store [B, K, X, S]
        return store.at[rows, :, :, idx].set(jnp.swapaxes(block, 1, 2), mode="drop")
      # store [B, K, S/128, X, 128]
      return store.at[rows, :, idx // VALUE_BLOCK, :, idx % VALUE_BLOCK].set(jnp.swapaxes(block, 1, 2), mode="drop")

    return self.replace(
        codes_k=put(self.codes_k, ck.codes), codes_v=put_v(self.codes_v, cv.codes),
        outl_k=put(self.outl_k, ck.outl), outl_v=put_v(self.outl_v, cv.outl),
        hi_k=None if self.hi_k is None else put(self.hi_k, ck.hi),
        hi_v=None if self.hi_v is None else put(self.hi_v, cv.hi),
        n_comp=self.n_comp + jnp.where(full, r, 0), n_res=jnp.where(full, 0, self.n_res))

  def _step(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, "OSKVPLayerCache"]:
    """q [B, N, H], k, v [B, K, H] -> (o [B, N, H], cache)."""
    cache = jax.lax.cond(jnp.any(self.n_res >= self.window), lambda c: c._flush(), lambda c: c, self)
    kr = jnp.einsum("BKH,BKHJ->BKJ", k.astype(jnp.float32), cache.u_k)
    vr = jnp.einsum("BKH,BKHJ->BKJ", v.astype(jnp.float32), cache.u_v)
    rows = jnp.arange(q.shape[0])
    cache = cache.replace(res_k=cache.res_k.at[rows, :, cache.n_res].set(kr.astype(cache.res_k.dtype)),
                          res_v=cache.res_v.at[rows, :, cache.n_res].set(vr.astype(cache.res_v.dtype)),
                          n_res=cache.n_res + 1)
    return cache._attend(q), cache

  def _implementation(self) -> str:
    """The decode-attention implementation: "auto" is "pallas" on the GPU, "xla" elsewhere."""
    if self.implementation == "auto":
      return "pallas" if backend.on_gpu() else "xla"
    return self.implementation

  def runs_mosaic_core(self, n_heads: int) -> bool:
    """Whether decode attention with `n_heads` query heads runs the fused Mosaic GPU core (`_attend`): a cache in a
    Mosaic GPU value layout (`values_for_mosaic`) decoded by "pallas" on a Hopper GPU, or off the GPU in Mosaic GPU's
    interpreter, at shapes `oskvp_uniform_codes.mosaic_tiling` takes. Reads static shapes only (abstract caches too)."""
    if not (self.values_for_mosaic and self._implementation() == "pallas" and self.hi_k is None
            and self.hi_v is None):
      return False
    # Imported here: the kernel lives in pallas_kernels/ and the XLA path must work without it.
    from moe_jax.kv_quant import oskvp_uniform_codes as uc  # pylint: disable=g-import-not-at-top
    from pallas_kernels import hopper  # pylint: disable=g-import-not-at-top
    k_heads, head_dim = self.kv_shape
    return hopper.mosaic_gpu_runs() and uc.mosaic_tiling(self.max_len, head_dim, n_heads // k_heads,
                                                         self.outl_k.shape[-1]) is not None

  def _attend(self, q: jax.Array) -> jax.Array:
    """q [B, N, H] -> o [B, N, H] over the stored tokens: the Mosaic GPU core where `runs_mosaic_core`, else
    `oskvp_decode_attention`."""
    impl = self._implementation()
    if self.runs_mosaic_core(q.shape[1]):
      from moe_jax.kv_quant import oskvp_uniform_codes as uc  # pylint: disable=g-import-not-at-top
      return uc.uniform_decode_attention(q, self.codes_k, self.outl_k, self.scale_k, self.cb_k, self.codes_v,
                                         self.outl_v, self.scale_v, self.cb_v, self.u_k, self.u_v, self.res_k,
                                         self.res_v, self.n_comp, self.n_res,
                                         interpret=backend.interpret_kernels())  # the CPU: Mosaic's interpreter
    codes_v, outl_v = self.value_store()
    return oskvp_decode_attention(q, self.codes_k, self.outl_k, self.scale_k, self.cb_k, codes_v, outl_v,
                                  self.scale_v, self.cb_v, self.u_k, self.u_v, self.res_k, self.res_v, self.n_comp,
                                  self.n_res, hi_k=self.hi_k, hi_v=self.hi_v, implementation=impl,
                                  symmetric_codebooks=self.symmetric,
                                  interpret=backend.interpret_kernels())  # "pallas" off the GPU: interpret mode

  def extend(self, q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array) -> tuple[jax.Array, "OSKVPLayerCache"]:
    """Appends T tokens one at a time (T is static; decode uses T=1; `extend_token_by_token`) and attends causally.

    Args:
      q: [B, T, N, H]; k, v: [B, T, K, H] (post-RoPE keys).
      starts: int32 [B]; unused, the cache tracks n_comp + n_res itself (== starts for a consistent caller).

    Returns:
      ([B, T, N, H], updated cache).
    """
    del starts
    # before_step's mark holds for the first token only: later tokens' first flushes refit here, in this layer.
    return extend_token_by_token(OSKVPLayerCache._step, self, q, k, v,
                                 after_first=lambda c: c.replace(refits_done=False))

  @jax.jit
  def dequantized(self) -> tuple[jax.Array, jax.Array]:
    """The keys and values the cache represents, in the original basis and token order.

    Returns:
      (k_hat, v_hat) f32 [B, S, K, H]: compressed tokens at [0, n_comp), the window at [n_comp, n_comp + n_res),
      zeros after.
    """
    s, r = self.max_len, self.window

    def one(codes, outl, scale, cb, hi, res, u):
      comp = dequantize_store(codes, outl, scale, cb, hi)  # [B, K, S, H]
      comp = jnp.where((jnp.arange(s)[None, :] < self.n_comp[:, None])[:, None, :, None], comp, 0.0)
      idx = jnp.clip(self.n_comp[:, None] + jnp.arange(r)[None, :], 0, s - 1)  # [B, R]
      live = (jnp.arange(r)[None, :] < self.n_res[:, None])[:, None, :, None]
      res = jnp.where(live, res.astype(jnp.float32), 0.0)
      rows = jnp.arange(res.shape[0])[:, None]
      full = comp.at[rows, :, idx].add(jnp.swapaxes(res, 1, 2))
      return jnp.einsum("BKSJ,BKHJ->BSKH", full, u)

    codes_v, outl_v = self.value_store()
    return (one(self.codes_k, self.outl_k, self.scale_k, self.cb_k, self.hi_k, self.res_k, self.u_k),
            one(codes_v, outl_v, self.scale_v, self.cb_v, self.hi_v, self.res_v, self.u_v))


def _refit_layers_rows(layers: tuple[OSKVPLayerCache, ...], rows: jax.Array,
                       valid: jax.Array) -> tuple[OSKVPLayerCache, ...]:
  """Fits U, codebooks and fp8 scales again for the rows int32 [C] in L layers at once, where valid bool [L, C] is
  set, by one `refit_mode.fit_layers` call over all L·C rows (one eigh call of [L·C, 2K, H, H]), on the R tokens of
  their windows, which they hold in the new basis after. Their compressed stores must be empty, as they are at the
  first flush. Pairs not valid (a chunk's padding, a row a layer does not flag) are computed and dropped."""
  windows = [layer._window_originals(rows) for layer in layers]  # pylint: disable=protected-access
  fits = layers[0].refit_mode.fit_layers(windows, jnp.full(rows.shape, layers[0].window, jnp.int32),
                                         rope_span=layers[0].max_len)  # keys: RoPE-shift augmented
  # pylint: disable-next=protected-access
  return tuple(layer._put_refit(rows, valid[i], *windows[i], *fits[i]) for i, layer in enumerate(layers))


def _refit_in_chunks(layers: tuple[OSKVPLayerCache, ...], todo: jax.Array) -> tuple[OSKVPLayerCache, ...]:
  """Refits the (layer, row) pairs set in todo bool [L, B] (`_refit_layers_rows`), the rows of any layer taken in
  order: while at least `refit_chunk_min_rows(c)` rows are left, the next c together, the rest one at a time, with
  c = max(1, refit_chunk // L) rows (at most B). A fit thus holds at most max(refit_chunk, L) (layer, row) pairs. A
  row is fitted in every layer that flags it, in the same call. One layer (H100, B = 8, K = 8, H = 128): a 1-row
  fit adds ~1.5 ms to the step, an 8-row one ~3.9 ms, so bursts of rows go in chunks. 48 layers at once (added to a
  step; results/oskvp_refit_across_layers_*_h100_s38.md, Lloyd-Max by one-hot scans then): ~23 ms for a row, +165
  for 8 rows in one fit, +172 one at a time, and +168 for 3 rows padded to a chunk of 8 against +67 one at a time:
  the fit is then bound by its work, not its calls, and a padded chunk costs its padding, so with L > refit_chunk / 2
  rows go one at a time. With the Lloyd kernel (`..._pallas_h100_s39.md`, `..._burst_pallas_h100_s39.md`) one at a
  time: +12.6 ms for a row, +36.4 for 3, +91.6 for 8 (padded chunks not re-timed; eigh, ~2/3 of a fit now, grows
  with the matrices too).
  Leaves the `refit` flags as they are."""
  b = todo.shape[1]
  if b == 0:  # an empty batch: nothing to refit (and no row for the fits' gathers to read)
    return layers
  c = min(b, max(1, layers[0].refit_mode.refit_chunk // len(layers)))  # rows per fit
  any_layer = jnp.any(todo, axis=0)  # [B]
  order = jnp.nonzero(any_layer, size=b + c, fill_value=0)[0]  # the rows to refit first, then padding
  count = jnp.sum(any_layer)

  def fit(n, pos, layers):  # rows order[pos : pos + n]; past count: padding
    rows = order[pos + jnp.arange(n)]
    return _refit_layers_rows(layers, rows, todo[:, rows] & (pos + jnp.arange(n) < count)[None])

  single = functools.partial(fit, 1)
  if c == 1:
    return jax.lax.fori_loop(0, count, single, layers)

  def body(carry):
    pos, layers = carry
    big = count - pos >= refit_chunk_min_rows(c)
    layers = jax.lax.cond(big, functools.partial(fit, c), single, pos, layers)
    return pos + jnp.where(big, c, 1), layers

  return jax.lax.while_loop(lambda carry: carry[0] < count, body, (jnp.int32(0), layers))[1]


def refit_before_step(layers: tuple) -> tuple:
  """The refits at the first flush of a decode step, for all layers at once, before the step's first layer runs.

  Every OS-KVP layer cache with refit flags (`OSKVPMode.refit_at_first_flush`) whose mode has `refit_across_layers`
  flushes at this step the rows whose window is full; their windows hold tokens of earlier steps only, so all
  layers' refits are known before any layer runs. They are done here, grouped by mode and shape, with one batched
  fit per chunk of rows for all layers of a group (`_refit_in_chunks`), instead of one per layer inside its flush;
  the flags of the flushing rows are cleared and the layers marked `refits_done`, so their own flushes only quantize
  (at the step's first token; further tokens of the same `extend` refit in their layer as before). The result is
  that of the per-layer refits (the same fits, batched differently). Other layers are returned as they are.
  layers: a model's layer caches (`KVCache.layers`)."""
  groups: dict[tuple, list[int]] = {}
  for i, layer in enumerate(layers):
    if (isinstance(layer, OSKVPLayerCache) and layer.refit is not None
        and layer.refit_mode.refit_across_layers):
      key = (layer.refit_mode, layer.kv_shape, layer.window, layer.max_len, layer.res_k.dtype, layer.n_res.shape)
      groups.setdefault(key, []).append(i)
  out = list(layers)
  for idx in groups.values():
    group = tuple(layers[i] for i in idx)
    full = jnp.stack([layer.n_res == layer.window for layer in group])  # [L, B]
    todo = full & jnp.stack([layer.refit for layer in group])
    # (A fresh branch function each time: cond caches its trace by function, which would outlive a patched fit.)
    group = jax.lax.cond(jnp.any(todo), lambda g, t: _refit_in_chunks(g, t), lambda g, _: g, group, todo)
    for i, layer, f in zip(idx, group, full):
      out[i] = layer.replace(refit=layer.refit & ~f, refits_done=True)
  return tuple(out)


def prefill_split(lengths: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
  """int32 [B] lengths -> (n_comp, n_res) with n_comp = R·floor((len - 1)/R), n_res = len - n_comp in [1, R]."""
  lengths = lengths.astype(jnp.int32)
  n_comp = jnp.maximum(lengths - 1, 0) // window * window
  return n_comp, lengths - n_comp


def build_layer_cache(k, v, lengths, cache_len: int, params_k: oskvp.OSKVPParams, params_v: oskvp.OSKVPParams, *,
                      window: int, implementation: str = "auto", symmetric: bool = False,
                      value_layout: str = "token_major") -> OSKVPLayerCache:
  """Quantizes the prefill into the layer layout.

  Args:
    k, v: [B, T, K, H] prefill keys (post-RoPE) / values; lengths int32 [B]; cache_len: S >= T.
    params_k, params_v: OSKVPParams with leading [B, K].
    window: R.
    symmetric: the codebooks are symmetric (`oskvp.fit(symmetric=True)`), which lets the kernel skip a plane type.
    value_layout: how the value codes and outliers are stored (`VALUE_LAYOUTS`): "token_major" [B, K, S, X], or
      for the Mosaic GPU cores (uniform codebooks) "token_contiguous" [B, K, X, S] or "block_major"
      [B, K, S/128, X, 128] (S a multiple of 128; `value_layout_for`).
  """
  if value_layout not in VALUE_LAYOUTS:
    raise ValueError(f"value_layout={value_layout!r} must be one of {VALUE_LAYOUTS}")
  if value_layout == "block_major" and cache_len % VALUE_BLOCK:
    raise ValueError(f"value_layout='block_major' needs cache_len={cache_len} to be a multiple of {VALUE_BLOCK}")
  b, t, kh, h = k.shape
  if cache_len < t:
    raise ValueError(f"cache_len={cache_len} is shorter than the prefill length {t}")
  n_comp, n_res = prefill_split(lengths, window)
  quant = jax.vmap(jax.vmap(oskvp.quantize))  # over B, K; x [T, H]

  def pack(x, params):
    xt = jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # [B, K, T, H]
    code = quant(xt, params)
    keep = (jnp.arange(t)[None, :] < n_comp[:, None])[:, None, :, None]  # [B, 1, T, 1]
    pad = lambda a: jnp.pad(jnp.where(keep, a, jnp.zeros((), a.dtype)),
                            ((0, 0), (0, 0), (0, cache_len - t), (0, 0)))
    xr = jnp.einsum("BKTH,BKHJ->BKTJ", xt, params.u)
    idx = jnp.clip(n_comp[:, None] + jnp.arange(window)[None, :], 0, t - 1)  # [B, R]
    res = jnp.take_along_axis(xr, idx[:, None, :, None], axis=2)  # [B, K, R, H]
    res = jnp.where((jnp.arange(window)[None, :] < n_res[:, None])[:, None, :, None], res, 0.0)
    hi = None if code.hi is None else pad(code.hi)
    return pad(code.codes), pad(code.outl), hi, res.astype(jnp.bfloat16)

  ck, ok, hk, rk = pack(k, params_k)
  cv, ov, hv, rv = pack(v, params_v)
  cv, ov = stored_values(cv, value_layout), stored_values(ov, value_layout)
  return OSKVPLayerCache(codes_k=ck, codes_v=cv, outl_k=ok, outl_v=ov, scale_k=params_k.scale,
                         scale_v=params_v.scale, cb_k=params_k.codebook, cb_v=params_v.codebook, u_k=params_k.u,
                         u_v=params_v.u, res_k=rk, res_v=rv, n_comp=n_comp, n_res=n_res, hi_k=hk, hi_v=hv,
                         implementation=implementation, symmetric=symmetric, value_layout=value_layout)
