"""OS-KVP fused decode attention: Pallas kernel (CPU interpret mode) vs its plain-jnp reference.

Every case draws a fresh random cache (random orthogonal U by QR, random codes, codebooks, fp8 outliers, scales,
bf16 residual window) and runs the kernel with its partial outputs poisoned with NaN (aliased buffers), so any
element the kernel forgets to write turns the result into NaN. Lengths are dynamic, so one compiled shape covers a
whole batch of awkward lengths. Tolerances: the "mma" form feeds bf16 operands to the dot (query, dequantized keys
and values, probabilities): relative L2 error <= 1.5e-2; the "lut" form is f32 throughout: <= 1e-3; the "bitplane"
form has int8 digits of the query (one: ~7 bits, two: ~15) and probabilities (two): <= 1.5e-2, as bf16.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from pallas_kernels.oskvp_decode_attention import (BITPLANE, PLAIN_ROWS, DecodeBlockConfig, _oskvp_pallas,
                                                   default_config, dequantize_rotated, oskvp_decode_attention,
                                                   oskvp_decode_attention_reference, unpack_codes)
from pallas_kernels.oskvp_decode_attention_bitplane import codebook_deltas, masked_plane_scales, planes
from pallas_kernels.oskvp_random import random_oskvp_inputs_host as random_oskvp_inputs

TOL = {"mma": 1.5e-2, "lut": 1e-3, "bitplane": 1.5e-2}


def rel_err(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def run_case(seed, config, symmetric=False, **shape):
  args = random_oskvp_inputs(seed, symmetric=symmetric, **shape)
  ref = oskvp_decode_attention_reference(*args)
  out = _oskvp_pallas(*args, interpret=True, config=config, poison=True, symmetric_codebooks=symmetric)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  # Per query head as well as overall: every row must be right, not only most of them.
  per_row = [rel_err(out[b], ref[b]) for b in range(out.shape[0])]
  assert max(per_row) < TOL[config.form], per_row
  return out, ref


CONFIGS = {
    "mma": DecodeBlockConfig(num_splits=5),  # the "mma" default (outliers on the tensor cores)
    "mma_first_timed": DecodeBlockConfig(block_s=128, num_stages=2, outlier_mma=False, num_splits=5),
    "mma_poly_decode": DecodeBlockConfig(block_s=32, num_splits=3, decode="poly"),
    "lut": DecodeBlockConfig(num_splits=5, form="lut"),
}
# The bit-plane form needs H >= 128 (planes of >= 32 channels).
BITPLANE_CONFIGS = {
    "bitplane": dataclasses.replace(BITPLANE, num_splits=3),  # the GPU default for H >= 128
    "bitplane_two_query_digits": dataclasses.replace(PLAIN_ROWS, block_s=64, num_splits=4, query_digits=2),
    "bitplane_two_heads_per_program": dataclasses.replace(PLAIN_ROWS, block_s=32, num_splits=2, heads_per_program=2),
    "bitplane_jnp_extract": dataclasses.replace(BITPLANE, block_s=32, num_splits=5, extract="jnp"),
    "bitplane_plain_rows": dataclasses.replace(PLAIN_ROWS, block_s=64, num_splits=3),
    "bitplane_compact_bf16_outliers_shifted_values": dataclasses.replace(BITPLANE, block_s=64, num_splits=3,
                                                                         outlier_f16=False, masked_value_planes=False),
    # The default's query prologue and value merge in XLA instead (the previous default).
    "bitplane_xla_prologue_and_merge": dataclasses.replace(BITPLANE, block_s=64, num_splits=3, pallas_prologue=False,
                                                           values_in_kernel=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_lengths_g4_h64(name):
  """One batch with lengths 1, 127, 1000 and a full 1024-token store; partly filled residual windows."""
  run_case(1, CONFIGS[name], batch=4, heads=8, kv_heads=2, head_dim=64, capacity=1024, window=48,
           n_comp=[1, 127, 1000, 1024], n_res=[0, 17, 48, 1])


def test_long_ragged_g1_h128():
  """4097 tokens (one past a power of two), G = 1, head dim 128, default tiling and splits."""
  run_case(2, DecodeBlockConfig(), batch=1, heads=2, kv_heads=2, head_dim=128, capacity=4097, window=128,
           n_comp=[4097], n_res=[100])


def test_g8_empty_store_more_splits_than_blocks_12_outliers():
  """G = 8; a row with an empty store (window only), a row with 3 tokens split 8 ways (empty splits); O = 12
  outlier channels (not a power of two: the tile is padded to 16 with masked columns)."""
  run_case(3, DecodeBlockConfig(block_s=16, num_splits=8, prefetch=True), batch=2, heads=16, kv_heads=2,
           head_dim=64, capacity=200, window=16, outliers=12, n_comp=[0, 3], n_res=[9, 16])


@pytest.mark.parametrize("name", list(BITPLANE_CONFIGS))
def test_bitplane_mixed_lengths_g4_h128(name):
  """Lengths 1, 127 and a full 600-token store in one batch; partly filled windows (one empty)."""
  run_case(11, BITPLANE_CONFIGS[name], batch=3, heads=8, kv_heads=2, head_dim=128, capacity=600, window=48,
           n_comp=[1, 127, 600], n_res=[0, 17, 48])


def test_bitplane_long_g1_and_g8():
  """4097 tokens at G = 1 (8 kv heads); G = 8 with an empty store, 1000 tokens and 12 outlier channels."""
  run_case(12, BITPLANE, batch=1, heads=4, kv_heads=4, head_dim=128, capacity=4097, window=128, n_comp=[4097],
           n_res=[100])
  run_case(13, dataclasses.replace(BITPLANE, num_splits=6), batch=2, heads=16, kv_heads=2, head_dim=128,
           capacity=1000, window=16, outliers=12, n_comp=[0, 1000], n_res=[9, 16])


def test_bitplane_compact_rows_g1_and_g8():
  """compact_rows folds 16 rows into G: G = 1 (16 row groups) and G = 8 (2 groups: no spare rows), both digit
  counts, symmetric and general codebooks."""
  compact = dataclasses.replace(BITPLANE, block_s=64, compact_rows=True)
  run_case(18, dataclasses.replace(compact, num_splits=2), batch=1, heads=4, kv_heads=4, head_dim=128, capacity=700,
           window=128, n_comp=[700], n_res=[100])
  run_case(19, dataclasses.replace(compact, num_splits=6, query_digits=2), symmetric=True, batch=2, heads=16,
           kv_heads=2, head_dim=128, capacity=1000, window=16, outliers=12, n_comp=[0, 1000], n_res=[9, 16])
  run_case(20, dataclasses.replace(compact, num_splits=3, outlier_f16=True, masked_value_planes=True),
           symmetric=True, batch=2, heads=2, kv_heads=2, head_dim=128, capacity=500, window=16, n_comp=[500, 77],
           n_res=[16, 3])
  # Values applied in the kernel with symmetric codebooks (off by default there) and with one query digit at G = 1.
  run_case(21, dataclasses.replace(compact, num_splits=4, values_in_kernel=True), symmetric=True, batch=2, heads=16,
           kv_heads=2, head_dim=128, capacity=300, window=16, outliers=12, n_comp=[300, 1], n_res=[0, 16])
  run_case(22, dataclasses.replace(compact, num_splits=2, query_digits=1, values_in_kernel=True), batch=1, heads=2,
           kv_heads=2, head_dim=128, capacity=200, window=16, n_comp=[200], n_res=[7])


@pytest.mark.parametrize("outliers,symmetric", [(64, False), (100, False), (40, True)])
def test_bitplane_outliers_past_the_first_plane(outliers, symmetric):
  """More outlier channels than a plane's H/4: with the values applied in the kernel (the default for general
  codebooks), channels past the first plane were dropped (relative error ~1 in rotated channels 32-63)."""
  config = dataclasses.replace(BITPLANE, block_s=64, num_splits=2, values_in_kernel=True)
  run_case(23, config, symmetric=symmetric, batch=2, heads=4, kv_heads=2, head_dim=128, capacity=200, window=16,
           outliers=outliers, n_comp=[200, 37], n_res=[5, 16])


def test_masked_planes_times_their_scales_are_the_bit_planes():
  """planes(masked=True) leaves each bit in place (b1 of plane 3 is int8 -128): times `masked_plane_scales` it is the
  0/1 plane exactly, for every byte value and every plane and type."""
  x = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8).reshape(8, 32)
  for p in range(4):
    exact = planes(x, p, "jnp")
    masked = planes(x, p, "jnp", masked=True)
    for e, m, s in zip(exact, masked, masked_plane_scales(p)):
      np.testing.assert_array_equal(np.asarray(m, np.float64) * s, np.asarray(e, np.float64))


def test_bitplane_symmetric_codebooks_two_plane_types():
  """Symmetric codebooks (cb0 + cb3 = cb1 + cb2): the kernel skips the b0 & b1 plane and still matches the
  reference (which uses the full codebooks); ragged lengths, G = 4 and G = 8. And the skip is not free on general
  codebooks: with asymmetric rows the same kernel is far off, so the test would catch a wrong flag (on the first
  case's shapes and lengths, so that its compiled kernel and reference are reused)."""
  config = dataclasses.replace(BITPLANE, block_s=64, num_splits=3)
  shape = dict(batch=3, heads=8, kv_heads=2, head_dim=128, capacity=600, window=48, n_comp=[1, 127, 600],
               n_res=[0, 17, 48])
  run_case(15, config, symmetric=True, **shape)
  run_case(16, dataclasses.replace(BITPLANE, block_s=32, num_splits=4, query_digits=2), symmetric=True, batch=1,
           heads=16, kv_heads=2, head_dim=128, capacity=300, window=16, n_comp=[300], n_res=[5])
  args = random_oskvp_inputs(17, **shape)
  wrong = _oskvp_pallas(*args, interpret=True, config=config, poison=True, symmetric_codebooks=True)
  assert rel_err(wrong, oskvp_decode_attention_reference(*args)) > 0.1


def test_codebook_deltas_rebuild_every_codebook_entry():
  """cb[c] = c0 + d1 b0 + d2 b1 + d3 b0 b1 with c = b0 + 2 b1, exactly (the identity the bit-plane form rests on)."""
  cb = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 4)), jnp.float32)
  c0, d1, d2, d3 = np.moveaxis(np.asarray(codebook_deltas(cb)), -2, 0)
  for c in range(4):
    b0, b1 = c & 1, c >> 1
    np.testing.assert_allclose(c0 + d1 * b0 + d2 * b1 + d3 * b0 * b1, np.asarray(cb)[..., c], rtol=0, atol=1e-6)


def test_bitplane_form_rejects_small_heads_and_default_picks_by_head_dim():
  args = random_oskvp_inputs(14, batch=1, heads=4, kv_heads=1, head_dim=64, capacity=32, window=16)
  with pytest.raises(ValueError, match="head dim >= 128"):
    _oskvp_pallas(*args, interpret=True, config=BITPLANE)
  assert default_config(64).form == "mma" and default_config(128) == BITPLANE == default_config(128, 8)
  assert default_config(128, 16).form == "bitplane" and not default_config(128, 16).compact_rows
  with pytest.raises(ValueError, match="query_digits"):
    DecodeBlockConfig(form="bitplane", query_digits=3)
  with pytest.raises(ValueError, match="compact_rows"):
    DecodeBlockConfig(compact_rows=True)  # the "mma" form
  with pytest.raises(ValueError, match="compact_rows"):
    DecodeBlockConfig(form="bitplane", compact_rows=True, heads_per_program=2)
  for field in ("pallas_prologue", "values_in_kernel"):
    with pytest.raises(ValueError, match=field):
      DecodeBlockConfig(form="bitplane", **{field: True})


def test_a_row_with_no_visible_token_gives_zeros_as_the_reference():
  """n_comp = n_res = 0 in one row: the merges divided 0 by 0 there (NaN in every form); the reference gives zeros."""
  for h, config in ((64, CONFIGS["mma"]), (64, CONFIGS["lut"]), (128, BITPLANE)):
    args = random_oskvp_inputs(21, batch=2, heads=4, kv_heads=2, head_dim=h, capacity=64, window=16, n_comp=[0, 10],
                               n_res=[0, 3])
    out = np.asarray(oskvp_decode_attention(*args, interpret=True, config=config), np.float32)
    ref = np.asarray(oskvp_decode_attention_reference(*args), np.float32)
    assert not ref[0].any() and not out[0].any(), config.form
    assert rel_err(out[1], ref[1]) < TOL[config.form]


def test_shapes_the_kernel_cannot_take_are_named_and_auto_falls_back_to_xla(monkeypatch):
  """Keys and values with different outlier counts ran, reading outl_v with outl_k's count (0.36-0.57 relative
  error, NaN with fewer); head dim 192 passed the old "multiple of 64" check and failed in Triton's lowering; an
  empty window failed inside Pallas' interpreter. "auto" on a GPU sent shapes the kernel refuses (head dim 32, as
  the tiny config's) to it instead of to XLA."""
  from moe_jax import backend  # pylint: disable=g-import-not-at-top
  from moe_jax.kv_quant import oskvp_attention  # pylint: disable=g-import-not-at-top
  shape = dict(batch=1, heads=4, kv_heads=2, capacity=64, n_comp=[40], n_res=[3])
  args = random_oskvp_inputs(22, head_dim=64, window=16, **shape)
  outl_v16 = jnp.zeros((*args[6].shape[:3], 16), args[6].dtype)
  mixed = args[:6] + (outl_v16, jnp.ones((*args[7].shape[:2], 16), jnp.float32)) + args[8:]
  cases = [(mixed, "outl_v has 16 outlier channels and outl_k 8"),
           (random_oskvp_inputs(23, head_dim=192, window=16, **shape), "head dim h=192 must be a power of two"),
           (random_oskvp_inputs(24, head_dim=32, window=16, **shape), "head dim h=32 must be a power of two >= 64"),
           (random_oskvp_inputs(25, head_dim=64, window=0, **dict(shape, n_res=[0])), "the window \\(R=0\\)")]
  monkeypatch.setattr(backend, "on_gpu", lambda: True)
  for case, message in cases:
    with pytest.raises(ValueError, match=message):
      oskvp_decode_attention(*case, interpret=True)
    auto = oskvp_attention.oskvp_decode_attention(*case, implementation="auto")  # the XLA reference, not the kernel
    np.testing.assert_array_equal(np.asarray(auto, np.float32),
                                  np.asarray(oskvp_attention.oskvp_decode_attention(*case, implementation="xla"),
                                             np.float32))


@pytest.mark.parametrize("name", list(CONFIGS) + list(BITPLANE_CONFIGS))
def test_lowers_to_triton_ir_for_hopper(name):
  """Lowers the real (non-interpret) kernel to Triton IR for an H100-class GPU on the CPU (`hopper_lowering.py`);
  benchmarks/decode_attention.py compiles it on the GPU."""
  args = random_oskvp_inputs(7, batch=2, heads=8, kv_heads=2, head_dim=128, capacity=300, window=128)
  config = {**CONFIGS, **BITPLANE_CONFIGS}[name]
  assert lowers_to_triton_for_hopper(functools.partial(_oskvp_pallas, interpret=False, config=config), *args)


def test_reference_matches_dense_attention_on_dequantized_cache():
  """The reference is plain softmax attention over [dequantized store ; window] rotated back: checked against an
  independent float64 numpy computation, including the planar code layout."""
  b, n, kh, h, s, r = 2, 4, 2, 64, 37, 8
  args = random_oskvp_inputs(4, batch=b, heads=n, kv_heads=kh, head_dim=h, capacity=s, window=r,
                             n_comp=[37, 5], n_res=[3, 0], q_dtype=jnp.float32)
  q, ck, ok, sk, cbk, cv, ov, sv, cbv, uk, uv, rk, rv, nc, nr = [np.asarray(x.astype(jnp.float32)) if x.dtype not in
                                                                (jnp.uint8, jnp.int32) else np.asarray(x) for x in args]
  qq = h // 4
  # Planar layout, decoded by hand: channel p*Q + i sits in byte i at bits 2p.
  codes = np.stack([(ck[..., i] >> (2 * p)) & 3 for p in range(4) for i in range(qq)], axis=-1)
  np.testing.assert_array_equal(np.asarray(unpack_codes(args[1])), codes)
  out = np.zeros((b, n, h))
  for bi in range(b):
    for ki in range(kh):
      def deq(c, o, sc, cb):
        x = np.take_along_axis(cb[bi, ki][None], c[bi, ki][..., None].astype(np.int64), axis=-1)[..., 0]
        x[:, :8] += o[bi, ki] * sc[bi, ki]
        return x
      kk = np.concatenate([deq(codes, ok, sk, cbk)[:nc[bi]], rk[bi, ki][:nr[bi]]]).astype(np.float64)
      vcodes = np.stack([(cv[..., i] >> (2 * p)) & 3 for p in range(4) for i in range(qq)], axis=-1)
      vv = np.concatenate([deq(vcodes, ov, sv, cbv)[:nc[bi]], rv[bi, ki][:nr[bi]]]).astype(np.float64)
      for g in range(n // kh):
        qr = q[bi, ki * (n // kh) + g].astype(np.float64) @ uk[bi, ki]
        sc = kk @ qr / np.sqrt(h)
        p = np.exp(sc - sc.max())
        p /= p.sum()
        out[bi, ki * (n // kh) + g] = (p @ vv) @ uv[bi, ki].T
  np.testing.assert_allclose(np.asarray(oskvp_decode_attention_reference(*args)), out, rtol=1e-4, atol=1e-4)
  k_hat = dequantize_rotated(args[1], args[2], args[3], args[4])
  assert k_hat.shape == (b, kh, s, h)


def test_entry_point_switch_and_validation():
  args = random_oskvp_inputs(5, batch=1, heads=4, kv_heads=1, head_dim=64, capacity=16, window=16)
  np.testing.assert_allclose(np.asarray(oskvp_decode_attention(*args, implementation="xla"), np.float32),
                             np.asarray(oskvp_decode_attention_reference(*args), np.float32))
  with pytest.raises(ValueError, match="implementation"):
    oskvp_decode_attention(*args, implementation="cuda")
  with pytest.raises(ValueError, match="block_s"):
    DecodeBlockConfig(block_s=48)
  with pytest.raises(ValueError, match="form"):
    DecodeBlockConfig(form="tma")
  bad = random_oskvp_inputs(6, batch=1, heads=3, kv_heads=2, head_dim=64, capacity=16, window=16)
  with pytest.raises(ValueError, match="kv heads must divide"):
    oskvp_decode_attention(*bad, interpret=True)


def test_entry_point_names_mismatched_value_side_and_lengths():
  args = list(random_oskvp_inputs(5, batch=2, heads=4, kv_heads=1, head_dim=64, capacity=16, window=16))
  cases = {5: ("codes_v", args[5][:, :, :8]), 8: ("cb_v", args[8][..., :2]), 12: ("res_v", args[12][:, :, :8]),
           14: ("n_res", np.ones(3, np.int32))}  # before: silent, a crash deep in the kernel, or NaN
  for implementation in ("xla", "pallas"):
    for i, (name, bad) in cases.items():
      with pytest.raises(ValueError, match=f"{name} must have shape"):
        oskvp_decode_attention(*args[:i], bad, *args[i + 1:], implementation=implementation, interpret=True)
    with pytest.raises(ValueError, match="n_comp must be an integer array"):
      oskvp_decode_attention(*args[:13], np.asarray(args[13], np.float32), args[14], implementation=implementation,
                             interpret=True)


def test_matches_kv_quant_reference_on_quantized_keys():
  """Real OS-KVP caches (moe_jax.kv_quant fits U, codebooks and fp8 scales on keys/values with outlier channels and
  quantizes them): the kernel matches kv_quant's own XLA decode attention, and so does this file's reference."""
  oskvp_modes = pytest.importorskip("moe_jax.kv_quant.oskvp_modes")
  oskvp_attention = pytest.importorskip("moe_jax.kv_quant.oskvp_attention")
  rng = np.random.default_rng(8)
  b, t, kh, n, h = 2, 200, 2, 8, 64
  chan = np.where(np.arange(h) < 3, 8.0, 1.0).astype(np.float32)  # a few large channels, as real keys have
  k = jnp.asarray(rng.standard_normal((b, t, kh, h), np.float32) * chan + 0.5)
  v = jnp.asarray(rng.standard_normal((b, t, kh, h), np.float32))
  lengths = jnp.asarray([200, 77], jnp.int32)
  # Jitted, as the model's prefill and decode run them (op by op, the fit alone compiles for ~6 s on CPU).
  mode = oskvp_modes.OSKVPMode(window=32, n_iters=4)
  cache = jax.jit(lambda k, v, lengths: mode.from_prefill(k, v, lengths, 256, layer=0))(k, v, lengths)
  q = jnp.asarray(rng.standard_normal((b, n, h), np.float32)).astype(jnp.bfloat16)
  args = (q, cache.codes_k, cache.outl_k, cache.scale_k, cache.cb_k, cache.codes_v, cache.outl_v, cache.scale_v,
          cache.cb_v, cache.u_k, cache.u_v, cache.res_k, cache.res_v, cache.n_comp, cache.n_res)
  theirs = oskvp_attention.oskvp_decode_attention_xla(*args)
  assert rel_err(oskvp_decode_attention_reference(*args), theirs) < 1e-2  # bf16 output rounding only
  out = _oskvp_pallas(*args, interpret=True, config=DecodeBlockConfig(block_s=32), poison=True)
  assert max(rel_err(out[i], theirs[i]) for i in range(b)) < TOL["mma"]


def test_refuses_caches_the_triton_offsets_cannot_index():
  """codes of 64 × 8 × 131072 × 32 bytes (2^31) are refused by the kernel path at trace time, naming the input;
  the XLA path still takes them."""
  b, kh, s, h, o, r = 64, 8, 131072, 128, 8, 128
  spec = jax.ShapeDtypeStruct
  side = (spec((b, kh, s, h // 4), jnp.uint8), spec((b, kh, s, o), jnp.float8_e4m3fn), spec((b, kh, o), jnp.float32),
          spec((b, kh, h, 4), jnp.float32))
  args = (spec((b, 32, h), jnp.bfloat16), *side, *side, *[spec((b, kh, h, h), jnp.float32)] * 2,
          *[spec((b, kh, r, h), jnp.bfloat16)] * 2, *[spec((b,), jnp.int32)] * 2)
  with pytest.raises(ValueError, match=r"^codes_k \(64, 8, 131072, 32\) uint8 has 2147483648 >= 2\^31 elements"):
    jax.eval_shape(oskvp_decode_attention, *args)
  assert jax.eval_shape(functools.partial(oskvp_decode_attention, implementation="xla"), *args).shape == (b, 32, h)


def test_default_form_at_g16_and_lengths_past_the_buffers():
  """G = 16 (qwen3_235b_a22b: 64 query heads over 4 kv heads) through the default form (before: compact rows refused
  it: 2 G > 16 rows), and n_comp > S / n_res > R read as the whole store / window as in the reference (before: the
  kernel indexed past the row, NaN here, another row's memory on a GPU)."""
  args = random_oskvp_inputs(21, batch=2, heads=32, kv_heads=2, head_dim=128, capacity=64, window=16,
                             n_comp=[40, 64], n_res=[3, 16])
  out = oskvp_decode_attention(*args, implementation="pallas", interpret=True)
  assert rel_err(out, oskvp_decode_attention_reference(*args)) < TOL["bitplane"]
  over = list(args)
  over[13], over[14] = np.array([72, 64], np.int32), np.array([3, 20], np.int32)  # n_comp > S, n_res > R
  want = oskvp_decode_attention_reference(*args[:13], np.array([64, 64], np.int32), np.array([3, 16], np.int32))
  two_dot = dataclasses.replace(default_config(128, 16), block_s=32, num_splits=2)
  for config in (DecodeBlockConfig(num_splits=2), two_dot):
    got = oskvp_decode_attention(*over, implementation="pallas", interpret=True, config=config)
    assert rel_err(got, want) < TOL[config.form], config.form
  with pytest.raises(ValueError, match=r"q must have rank 3"):
    oskvp_decode_attention(args[0][:, 0], *args[1:], implementation="xla")
