"""The OS-KVP layer cache (`kv_cache="oskvp"`, `"oskvp3"`, `"oskvp_static"`): a compressed store plus a rotated
bf16 residual window, and the modes that build it from the prefill.

Layout per layer (every leaf batch-leading, shared with `pallas_kernels/oskvp_decode_attention.py`):
  codes_k, codes_v  uint8 [B, K, S, H/4]     2-bit codes, planar-packed (see `oskvp.pack2`)
  hi_k, hi_v        uint8 [B, K, S, H/8]     third code bit (bits=3 only, else None)
  outl_k, outl_v    float8_e4m3fn [B, K, S, O]
  (values_contiguous caches, `OSKVPMode(uniform=True)`: codes_v uint8 [B, K, H/4, S] and outl_v [B, K, O, S], the
  value tokens contiguous as the Mosaic GPU core streams them; `value_store` gives the token-major view)
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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from moe_jax.kv_quant import lloyd, oskvp
from moe_jax.kv_quant.oskvp_attention import dequantize_store, oskvp_decode_attention
from moe_jax.layers import rope


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
  values_contiguous: bool = struct.field(pytree_node=False, default=False)  # codes_v, outl_v [B, K, X, S]
  refit_mode: OSKVPMode | None = struct.field(pytree_node=False, default=None)  # whose `fit` refits (with refit)
  # Set by `refit_before_step` for the step's first token, whose refits it has done (`extend` clears it after).
  refits_done: bool = struct.field(pytree_node=False, default=False)

  @property
  def max_len(self) -> int:
    return self.codes_k.shape[2]

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
    the whole store for a values_contiguous cache: for the XLA reference and the Triton kernel)."""
    if not self.values_contiguous:
      return self.codes_v, self.outl_v
    return jnp.swapaxes(self.codes_v, -1, -2), jnp.swapaxes(self.outl_v, -1, -2)

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

    def put_v(store, block):  # token-major, or store [B, K, X, S] (values_contiguous); both index as [B, R, K, X]
      if not self.values_contiguous:
        return put(store, block)
      return store.at[rows, :, :, idx].set(jnp.swapaxes(block, 1, 2), mode="drop")

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
      return "pallas" if jax.default_backend() == "gpu" else "xla"
    return self.implementation

  def runs_mosaic_core(self, n_heads: int) -> bool:
    """Whether decode attention with `n_heads` query heads runs the fused Mosaic GPU core (`_attend`): a
    values_contiguous cache decoded by "pallas" on a Hopper GPU, or off the GPU in Mosaic GPU's interpreter, at
    shapes `oskvp_uniform_codes.mosaic_tiling` takes. Reads static shapes only (abstract caches too)."""
    if not (self.values_contiguous and self._implementation() == "pallas" and self.hi_k is None
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
                                         interpret=jax.default_backend() != "gpu")  # the CPU: Mosaic's interpreter
    codes_v, outl_v = self.value_store()
    return oskvp_decode_attention(q, self.codes_k, self.outl_k, self.scale_k, self.cb_k, codes_v, outl_v,
                                  self.scale_v, self.cb_v, self.u_k, self.u_v, self.res_k, self.res_v, self.n_comp,
                                  self.n_res, hi_k=self.hi_k, hi_v=self.hi_v, implementation=impl,
                                  symmetric_codebooks=self.symmetric,
                                  interpret=jax.default_backend() != "gpu")  # "pallas" off the GPU: interpret mode

  def extend(self, q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array) -> tuple[jax.Array, "OSKVPLayerCache"]:
    """Appends T tokens one at a time (T is static; decode uses T=1) and attends causally.

    Args:
      q: [B, T, N, H]; k, v: [B, T, K, H] (post-RoPE keys).
      starts: int32 [B]; unused, the cache tracks n_comp + n_res itself (== starts for a consistent caller).

    Returns:
      ([B, T, N, H], updated cache).
    """
    del starts
    if q.shape[1] == 0:  # nothing appended (attention returns q's dtype); before_step's mark ends with the step
      return jnp.zeros(q.shape, q.dtype), self.replace(refits_done=False)
    cache, outs = self, []
    for t in range(q.shape[1]):
      o, cache = cache._step(q[:, t], k[:, t], v[:, t])
      cache = cache.replace(refits_done=False)  # the next token's first flushes refit here, in this layer
      outs.append(o)
    return jnp.stack(outs, axis=1), cache

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
                      values_contiguous: bool = False) -> OSKVPLayerCache:
  """Quantizes the prefill into the layer layout.

  Args:
    k, v: [B, T, K, H] prefill keys (post-RoPE) / values; lengths int32 [B]; cache_len: S >= T.
    params_k, params_v: OSKVPParams with leading [B, K].
    window: R.
    symmetric: the codebooks are symmetric (`oskvp.fit(symmetric=True)`), which lets the kernel skip a plane type.
    values_contiguous: store the value codes and outliers tokens contiguous ([B, K, X, S]; the Mosaic GPU core's
      layout, for uniform codebooks).
  """
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
  if values_contiguous:
    cv, ov = jnp.swapaxes(cv, -1, -2), jnp.swapaxes(ov, -1, -2)
  return OSKVPLayerCache(codes_k=ck, codes_v=cv, outl_k=ok, outl_v=ov, scale_k=params_k.scale,
                         scale_v=params_v.scale, cb_k=params_k.codebook, cb_v=params_v.codebook, u_k=params_k.u,
                         u_v=params_v.u, res_k=rk, res_v=rv, n_comp=n_comp, n_res=n_res, hi_k=hk, hi_v=hv,
                         implementation=implementation, symmetric=symmetric, values_contiguous=values_contiguous)


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
      tensor-core operand of the fused Mosaic GPU core (`pallas_kernels/oskvp_decode_core_mgpu.py`), which decode
      attention uses on the GPU where it applies (`oskvp_uniform_codes.mosaic_tiling`; the cache then stores its
      values tokens contiguous); elsewhere the Triton kernel (two plane types: uniform codebooks are symmetric) or
      the XLA reference over the token-major view. Fidelity in benchmarks/results/kv_cache.md.
    refit_at_first_flush: a sequence whose prompt is shorter than the window (nothing coded at prefill) is fitted
      when its window is first full, on those R tokens, so its codes come from a fit on R tokens, the coded ones
      among them, instead of one on the prompt alone (a prompt shorter than H falls back to a permutation basis and
      levels as wide as its magnitude). A prefill whose prompts are all shorter than R fits nothing then
      (`oskvp.placeholder`), so each such row is fitted once. Costs a fit of the row in every layer inside that
      decode step (all layers in one fit with `refit_across_layers`); measured in the README's OS-KVP section. A
      serving engine clears the flag of its free slots (`moe_jax.serving.steps.decode_slots`), which step too.
    refit_chunk: how many rows one batched fit refits at a flush (`oskvp_cache._refit_in_chunks`): refit_chunk rows
      of one layer (`OSKVPLayerCache._refit_first_flushes`), max(1, refit_chunk // L) rows of L layers fitted
      together (`refit_across_layers`). While `refit_chunk_min_rows` or more rows are left, that many
      (or fewer, padded) are fitted together, the rest one at a time. A fit's eigh call costs about the same for 1
      row as for 8 on the GPU, and a fit pays for its padding rows too, so chunks pay off for bursts of rows (many
      prompts admitted at once), single fits for the lone row of continuous batching. 1: always one row at a time.
    refit_across_layers: the model's decode step refits all its layers' flushing rows together before its first
      layer runs (`refit_before_step`: one batched fit per chunk of rows for all layers), instead of one fit per
      layer inside each layer's flush: one fit of a row in 48 layers (+12.6 ms a step on an H100 with the Lloyd
      kernel; +23 with one-hot Lloyd scans) costs far less than 48 one-layer fits (+71 ms a step, one-hot). The same
      fits either way; False keeps the per-layer refit (for comparison).
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
    interpret = jax.default_backend() != "gpu" if impl == "pallas" else None
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
                                     values_contiguous=self.uniform) for (k, v), (pk, pv) in zip(kvs, params))
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
