"""The fused Mosaic GPU OS-KVP core (uniform codebooks): interpret mode against its blockwise model and the exact
softmax, the GPU route's lowering, argument errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_value_layout as vl
from pallas_kernels import oskvp_value_sums_mgpu as vs
from pallas_kernels.mosaic_gpu_introspect import mosaic_module_text

Q = 32


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _inputs(seed, bk, s, g=4, scale=0.004):
  """One program per shape (op by op, the draws compile a program per operation)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  kc = jax.random.bits(k1, (bk, s, Q), jnp.uint8)
  vc = jax.random.bits(k2, (bk, Q, s), jnp.uint8)
  qd = jax.random.randint(k3, (bk, dc.N, 4 * Q), -127, 128).astype(jnp.int8).at[:, g:].set(0)
  return kc, vc, qd, jnp.full((bk, dc.N), scale, jnp.float32)


@pytest.mark.parametrize("bk,s,block_s,splits,steps,g", [(2, 256, 64, 2, 2, 4), (1, 768, 128, 3, 2, 8),
                                                         (2, 512, 64, 1, 3, 1), (1, 1024, 256, 2, 2, 4)])
def test_matches_blockwise_model(bk, s, block_s, splits, steps, g):
  """The kernel does the blockwise model's arithmetic (running max per block, p8 = round(127·2^(s − m)), rescaled
  int32 block sums, log-sum-exp over splits): equal to 1e-3 (f32 summation order; a rounding tie of p8 may land on
  the other level between XLA's exp2 and the kernel's, ~2e-4 for one token of 127)."""
  args = _inputs(bk * s + splits, bk, s, g)
  got = np.asarray(dc.decode_core_mgpu(*args, block_s=block_s, splits=splits, max_concurrent_steps=steps,
                                       interpret=True))
  want = np.asarray(dc.decode_core_blockwise_reference(*args, block_s=block_s, splits=splits))
  assert got.shape == (bk, dc.N, 4 * Q)
  np.testing.assert_allclose(got[:, :g], want[:, :g], atol=1e-3)


def test_l2_resident_ablation_reloads_each_splits_first_block():
  """ablate="l2_resident" (a timing experiment) streams each split's first block at every step: it must equal the
  kernel on a cache whose blocks repeat their split's first block, and differ from the kernel on the real cache."""
  bk, s, block_s, splits = 1, 256, 64, 2
  kc, vc, qd, qs = _inputs(7, bk, s)
  per_split = s // splits
  tok = np.concatenate([np.tile(np.arange(j * per_split, j * per_split + block_s), per_split // block_s)
                        for j in range(splits)])
  kw = dict(block_s=block_s, splits=splits, max_concurrent_steps=2, interpret=True)
  got = np.asarray(dc.decode_core_mgpu(kc, vc, qd, qs, ablate="l2_resident", **kw))
  want = np.asarray(dc.decode_core_mgpu(kc[:, tok], vc[:, :, tok], qd, qs, **kw))
  real = np.asarray(dc.decode_core_mgpu(kc, vc, qd, qs, **kw))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.abs(got - real).max() > 1e-2


def test_ragged_lengths():
  """Lengths 0, 1, 127, 300 and full in one batch (capacity 512): tokens past a row's length are masked in the
  kernel; length 1 gives that token's value codes exactly, length 0 zeros, the rest track both references."""
  kc, vc, qd, qs = _inputs(11, 5, 512)
  lens = jnp.array([0, 1, 127, 300, 512], jnp.int32)
  got = np.asarray(dc.decode_core_mgpu(kc, vc, qd, qs, lens, block_s=64, splits=2, max_concurrent_steps=2,
                                       interpret=True))[:, :4]
  model = np.asarray(dc.decode_core_blockwise_reference(kc, vc, qd, qs, lens, block_s=64, splits=2))[:, :4]
  exact = np.asarray(dc.decode_core_reference(kc, vc, qd, qs, lens))[:, :4]
  np.testing.assert_allclose(got, model, atol=1e-3)
  assert np.abs(got - exact).max() < 0.1
  np.testing.assert_array_equal(got[0], 0.0)
  first = np.asarray(vs.value_planes_reference(vc[1], 1))[:, 0].astype(np.float32)  # token 0's codes [H]
  np.testing.assert_allclose(got[1], np.broadcast_to(first, got[1].shape), atol=1e-6)


def test_blockwise_model_tracks_the_exact_softmax():
  """The only approximation is p's 127 levels: on a peaked and a flat score distribution the output (expected
  code values, 0..3) stays within 0.1 of the exact softmax's; for one dominant token it is that token's codes."""
  kc, vc, qd, qs = _inputs(3, 2, 1024)
  for scale in (0.02, 0.001):
    qs_ = jnp.full_like(qs, scale)
    model = np.asarray(dc.decode_core_blockwise_reference(kc, vc, qd, qs_, block_s=64, splits=4))[:, :4]
    exact = np.asarray(dc.decode_core_reference(kc, vc, qd, qs_))[:, :4]
    assert np.abs(model - exact).max() < 0.1, (scale, np.abs(model - exact).max())
  qs_ = jnp.full_like(qs, 1.0)  # scores in units of 2^1: the top token takes all the mass
  model = np.asarray(dc.decode_core_blockwise_reference(kc, vc, qd, qs_, block_s=64, splits=4))[:, :4]
  exact = np.asarray(dc.decode_core_reference(kc, vc, qd, qs_))[:, :4]
  np.testing.assert_allclose(model, exact, atol=1e-3)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _outliers(seed, bk, s, g=4):
  """One program per shape (op by op, the draws compile a program per operation)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  kout = (jax.random.normal(k1, (bk, s, dc.OUTLIERS)) * 2).astype(jnp.float8_e4m3fn)
  vout = (jax.random.normal(k2, (bk, dc.OUTLIERS, s)) * 2).astype(jnp.float8_e4m3fn)  # tokens contiguous
  qo = (jax.random.normal(k3, (bk, dc.N, dc.OUTLIERS)) * 0.3).at[:, g:].set(0).astype(jnp.float16)
  return kout, vout, qo


@pytest.mark.parametrize("value_outliers", dc.VALUE_OUTLIER_FORMS)
def test_outlier_channels(value_outliers):
  """fp8 outlier channels: their scores join the softmax (f16 wgmma) and their value sums come out beside the
  codes' (either form); equal to the blockwise model to 1e-3 and, for a one-token row, exactly that token's value
  outliers."""
  kc, vc, qd, qs = _inputs(13, 3, 512)
  kout, vout, qo = _outliers(14, 3, 512)
  lens = jnp.array([1, 300, 512], jnp.int32)
  got, got_o = dc.decode_core_mgpu(kc, vc, qd, qs, lens, kout, vout, qo, block_s=64, splits=2,
                                   max_concurrent_steps=2, interpret=True, value_outliers=value_outliers)
  want, want_o = dc.decode_core_blockwise_reference(kc, vc, qd, qs, lens, kout, vout, qo, block_s=64, splits=2)
  assert got_o.shape == (3, dc.N, dc.OUTLIERS)
  np.testing.assert_allclose(np.asarray(got)[:, :4], np.asarray(want)[:, :4], atol=1e-3)
  np.testing.assert_allclose(np.asarray(got_o)[:, :4], np.asarray(want_o)[:, :4], atol=1e-3)
  first = np.asarray(vout[0, :, 0].astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(got_o)[0, :4], np.broadcast_to(first, (4, 8)), atol=1e-6)
  exact, exact_o = dc.decode_core_reference(kc, vc, qd, qs, lens, kout, vout, qo)
  assert np.abs(np.asarray(got_o - exact_o))[:, :4].max() < 0.15  # p's 127 levels; outliers up to ±8
  assert np.abs(np.asarray(got - exact))[:, :4].max() < 0.1
  # The key outliers move the scores: without them the output differs.
  plain = dc.decode_core_mgpu(kc, vc, qd, qs, lens, block_s=64, splits=2, max_concurrent_steps=2, interpret=True)
  assert np.abs(np.asarray(plain - got))[1:, :4].max() > 0.05


def test_two_passes_per_step_with_outliers_and_ragged_lengths():
  """block_s=256: two 128-token passes per pipeline step share the step's max, p8's parts sit in rows 16i.. of one
  A tile (4 value-outlier parts); equal to the blockwise model at block 256 to 1e-3, a one-token row gives exactly
  that token's value outliers."""
  kc, vc, qd, qs = _inputs(15, 3, 1024)
  kout, vout, qo = _outliers(16, 3, 1024)
  lens = jnp.array([1, 300, 1000], jnp.int32)
  got, got_o = dc.decode_core_mgpu(kc, vc, qd, qs, lens, kout, vout, qo, block_s=256, splits=2,
                                   max_concurrent_steps=2, interpret=True)
  want, want_o = dc.decode_core_blockwise_reference(kc, vc, qd, qs, lens, kout, vout, qo, block_s=256, splits=2)
  np.testing.assert_allclose(np.asarray(got)[:, :4], np.asarray(want)[:, :4], atol=1e-3)
  np.testing.assert_allclose(np.asarray(got_o)[:, :4], np.asarray(want_o)[:, :4], atol=1e-3)
  first = np.asarray(vout[0, :, 0].astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(got_o)[0, :4], np.broadcast_to(first, (4, 8)), atol=1e-6)
  for form in ("fp8", "f16"):  # the passes share one A tile of the stacked form only
    with pytest.raises(ValueError, match="fp8_stacked"):
      dc.decode_core_mgpu(kc, vc, qd, qs, lens, kout, vout, qo, block_s=256, splits=2, interpret=True,
                          value_outliers=form)


def test_split_outputs_are_written_whole():
  """`decode_core_splits` writes every element of its outputs: ml's rows are m, l and a zero tail, so a reader never
  meets the ring's leftover shared memory (which the interpreter fills with NaN)."""
  bk, s = 2, 512
  kc, vc, qd, qs = _inputs(17, bk, s)
  kout, vout, qo = _outliers(18, bk, s)
  qs_row = jnp.zeros((bk, 32), jnp.float32).at[:, :dc.N].set(qs).at[:, dc.N].set(jnp.array([300.0, 512.0]))
  qo16 = jnp.concatenate([qo, jnp.zeros_like(qo)], -1)
  acc, ml, acco = dc.decode_core_splits(kc, vc, qd, qs_row, kout, vout, qo16, block_s=64, splits=2, interpret=True)
  assert np.isfinite(np.asarray(acc)).all() and np.isfinite(np.asarray(acco)).all()
  np.testing.assert_array_equal(np.asarray(ml)[..., 2 * dc.N:], 0.0)
  assert np.isfinite(np.asarray(ml)).all() and (np.asarray(ml)[..., dc.N:2 * dc.N] > 0).all()


def test_block_major_values_give_the_same_outputs():
  """Block-major value codes and outliers (`oskvp_value_layout`) fill the same shared-memory tiles as the
  tokens-contiguous ones: the kernel's outputs are bit-equal, merged (ragged lengths, outliers) and per split."""
  bk, s = 3, 512
  kc, vc, qd, qs = _inputs(19, bk, s)
  kout, vout, qo = _outliers(20, bk, s)
  lens = jnp.array([1, 300, 512], jnp.int32)
  vcb, voutb = vl.block_major(vc), vl.block_major(vout)
  assert vcb.shape == (bk, s // 128, Q, 128)
  np.testing.assert_array_equal(np.asarray(vl.from_block_major(vcb, True)), np.asarray(vc))
  kw = dict(block_s=128, splits=2, max_concurrent_steps=2, interpret=True)
  want = dc.decode_core_mgpu(kc, vc, qd, qs, lens, kout, vout, qo, return_lse2=True, **kw)
  got = dc.decode_core_mgpu(kc, vcb, qd, qs, lens, kout, voutb, qo, return_lse2=True, **kw)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ref = dc.decode_core_blockwise_reference(kc, vc, qd, qs, lens, kout, vout, qo, block_s=128, splits=2)
  np.testing.assert_allclose(np.asarray(got[0])[:, :4], np.asarray(ref[0])[:, :4], atol=1e-3)
  qs_row = dc.padded_scales(qs, lens, s)
  qo16 = jnp.concatenate([qo, jnp.zeros_like(qo)], -1)
  want = dc.decode_core_splits(kc, vc, qd, qs_row, kout, vout, qo16, **kw)
  got = dc.decode_core_splits(kc, vcb, qd, qs_row, kout, voutb, qo16, **kw)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_p8_is_exact():
  """Every p8 level 0..127 is hi + lo with both parts representable in e4m3 (the fp8 value form's sums equal the
  f16 form's); hi is p8 rounded to e4m3 and |lo| <= 4."""
  p8 = jnp.arange(128, dtype=jnp.int32)
  hi, lo = dc.split_p8(p8)
  assert hi.dtype == lo.dtype == jnp.float8_e4m3fn
  hi, lo = np.asarray(hi.astype(jnp.float32)), np.asarray(lo.astype(jnp.float32))
  np.testing.assert_array_equal(hi + lo, np.arange(128))
  np.testing.assert_array_equal(hi, np.asarray(p8.astype(jnp.float8_e4m3fn).astype(jnp.float32)))
  assert np.abs(lo).max() == 4


@pytest.mark.parametrize("shape,source,tile", [((128, 16), "key", (64, 16)), ((64, 128), "value", (8, 128))])
def test_outlier_fragment_index_math(shape, source, tile):
  """The GPU route's A operands of the outlier wgmmas, built from 2-byte loads: for every thread and register of
  Mosaic's WGMMA layout, the index math (`key_outlier_source` / `value_outlier_source`, the same code that emits the
  loads) names the fp8 pair that belongs there: key tile [block_s / 2, 16] = tokens' 8 channels two per row, value
  tile [8, block_s] repeated to 64 rows with its tokens permuted along K; the value side's registers of one 32-token
  group are 8 consecutive bytes of a row (one 8-byte load)."""
  from jax.experimental.mosaic import gpu as mgpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.mosaic_gpu_introspect import layout_split  # pylint: disable=g-import-not-at-top
  src = np.arange(np.prod(tile)).reshape(tile)  # element ids of the tile
  if source == "key":  # A[t, c] = kout[t, c] for c < 8, else 0
    want = np.concatenate([src.reshape(shape[0], 8), np.full((shape[0], 8), -1)], axis=1)
    fn = rg.key_outlier_source
  else:  # A[r, k] = vout[r % 8, k_to_token(k)] (columns permuted; p is stored with the same permutation)
    perm = np.array([rg.k_to_token(rg.Ints, k) for k in range(shape[1])])
    assert sorted(perm) == list(range(shape[1]))
    assert [rg.token_to_k(rg.Ints, t) for t in perm] == list(range(shape[1]))
    want = np.tile(src[:, perm], (8, 1))
    fn = rg.value_outlier_source
  got = np.full(shape, -2)
  layout = mgpu.WGMMA_LAYOUT
  for (r, c), (thread, reg, pos) in layout_split(layout, shape).items():
    warp, lane = thread[0], thread[1] * 4 + thread[2]
    where = fn(rg.Ints, reg, warp, lane)
    got[r, c] = -1 if where is None else src[where[0], where[1] + pos]
    if source == "value":  # register kt = 4g + pair: byte 2·pair of the thread's 8-byte word of group g
      kt = reg[1]
      base = rg.value_outlier_source(rg.Ints, (0, 4 * (kt // 4), 0, 0, 0), warp, lane)
      assert where == (base[0], base[1] + 2 * (kt % 4)) and base[1] % 8 == 0
  np.testing.assert_array_equal(got, want)


def _abstract_inputs(s: int):
  """Shapes only (BK = 2, S = s): kcodes, vcodes, qd, qs, then kout, vout, qo, for lowering without data."""
  return (jax.ShapeDtypeStruct((2, s, Q), jnp.uint8), jax.ShapeDtypeStruct((2, Q, s), jnp.uint8),
          jax.ShapeDtypeStruct((2, dc.N, 4 * Q), jnp.int8), jax.ShapeDtypeStruct((2, dc.N), jnp.float32),
          jax.ShapeDtypeStruct((2, s, dc.OUTLIERS), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((2, dc.OUTLIERS, s), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((2, dc.N, dc.OUTLIERS), jnp.float16))


def test_gpu_route_lowers():
  """Per 128-token block: 8 key and 8 value int8 wgmmas (codes as A in registers), and p stored by hand."""
  kc, vc, qd, qs, ko, vo, qo = _abstract_inputs(2048)
  f = jax.jit(lambda *a: dc.decode_core_mgpu(*a, block_s=128, splits=2, max_concurrent_steps=2))
  text = mosaic_module_text(f.trace(kc, vc, qd, qs).lower(lowering_platforms=("cuda",)))
  instr = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n8k32\.s32\.s8\.s8) \{[^}]*\}", text)
  assert len(instr) == 16
  loop = text[text.index("scf.for"):]
  assert len(re.findall(r"wgmma\.mma_async", loop)) == 16
  # p8 [128 tokens, 8] stored transposed by hand: 8 byte stores per thread into the tiled [8, 128] buffer.
  assert len(re.findall(r"memref\.store\"\(.*\(i8, memref<1x1x8x128xi8", text)) == 8
  # With outlier channels: + 2 key-outlier f16 wgmmas (M groups, A in registers) per block, and the value-outlier
  # sums: "f16": 8 more f16 wgmmas (k16 steps), A in registers, p8 stored a second time, as f16; "fp8": 2 × 4
  # e4m3 wgmmas (k32 steps), both operands in shared memory, p8's two e4m3 parts stored (8 bytes each per thread);
  # "fp8_stacked": the two parts in one A tile, 4 e4m3 wgmmas.
  for form, n_f16, n_fp8, f16_stores, fp8_stores in (("f16", 10, 0, 8, 0), ("fp8", 2, 8, 0, 16),
                                                      ("fp8_stacked", 2, 4, 0, 16)):
    f = jax.jit(lambda *a, form=form: dc.decode_core_mgpu(*a[:4], None, *a[4:], block_s=128, splits=2,
                                                          max_concurrent_steps=2, value_outliers=form))
    text = mosaic_module_text(f.trace(kc, vc, qd, qs, ko, vo, qo).lower(lowering_platforms=("cuda",)))
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.s32\.s8\.s8", text)) == 16
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16\.f32\.f16\.f16 \{", text)) == n_f16
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3 \{", text)) == n_fp8
    assert len(re.findall(r"memref\.store\"\(.*\(f16, memref<1x2x8x64xf16", text)) == f16_stores
    assert len(re.findall(r"memref\.store\"\(.*\(f8E4M3FN, memref<8x1x8x128xf8E4M3FN", text)) == fp8_stores


def test_gpu_route_lowers_block_major_values():
  """Block-major values lower to the same wgmmas as tokens-contiguous ones (the s8 key and value ones, the outliers'
  f16 and e4m3 ones), the TMA source being the [BK, S/128 · X, 128] view (one contiguous 4 KB of codes and 1 KB of
  outliers a step) instead of [BK, X, S]."""
  kc, vc, qd, qs, ko, vo, qo = _abstract_inputs(2048)
  vcb, vob = (jax.ShapeDtypeStruct((2, 16, x, 128), d) for x, d in ((Q, jnp.uint8), (dc.OUTLIERS, vo.dtype)))
  f = jax.jit(lambda *a: dc.decode_core_mgpu(*a[:4], None, *a[4:], block_s=128, splits=2, max_concurrent_steps=2))
  tokens, blocks = (mosaic_module_text(f.trace(kc, v, qd, qs, ko, o, qo).lower(lowering_platforms=("cuda",)))
                    for v, o in ((vc, vo), (vcb, vob)))
  wgmmas = lambda text: sorted(re.findall(r"wgmma\.mma_async\.sync\.aligned\.[a-z0-9.]+", text))
  assert wgmmas(blocks) == wgmmas(tokens)
  assert len(re.findall(r"m64n8k32\.s32\.s8\.s8", " ".join(wgmmas(blocks)))) == 16
  assert "memref<2x512x128xi8>" in blocks and "memref<2x128x128xf8E4M3FN>" in blocks
  assert "memref<2x32x2048xi8>" not in blocks and "memref<2x8x2048xf8E4M3FN>" not in blocks
  assert "memref<2x32x2048xi8>" in tokens


def test_gpu_route_lowers_two_passes_per_step():
  """block_s=256: twice the wgmmas of block 128 per step (value sums with K = 256, the value-outlier sums of each
  pass against its half of the tile), p8 stored into both column tiles of [8, 256], and shared memory within
  55 KB (ring 2 × 20 KB): four programs per SM, as at block 128."""
  kc, vc, qd, qs, ko, vo, qo = _abstract_inputs(4096)
  f = jax.jit(lambda *a: dc.decode_core_mgpu(*a[:4], None, *a[4:], block_s=256, splits=2, max_concurrent_steps=2))
  text = mosaic_module_text(f.trace(kc, vc, qd, qs, ko, vo, qo).lower(lowering_platforms=("cuda",)))
  assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.s32\.s8\.s8", text)) == 32
  assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16\.f32\.f16\.f16 \{", text)) == 4
  assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3 \{", text)) == 8
  assert len(re.findall(r"memref\.store\"\(.*\(i8, memref<1x2x8x128xi8", text)) == 16
  assert len(re.findall(r"memref\.store\"\(.*\(f8E4M3FN, memref<8x1x8x128xf8E4M3FN", text)) == 32
  smem = [int(b) for b in re.findall(r"memref<(\d+)xi8, #gpu\.address_space<workgroup>>", text)]
  # 4 × (this + the barriers, 24 bytes, + the 1 KB the driver reserves per block) <= 228 KB per SM
  assert smem and max(smem) <= 55 * 1024, smem


def test_rejects_bad_arguments():
  kc, vc, qd, qs = _inputs(0, 1, 256)
  with pytest.raises(TypeError, match="uint8"):
    dc.decode_core_mgpu(kc.astype(jnp.int8), vc, qd, qs, interpret=True)
  with pytest.raises(ValueError, match="tokens contiguous"):
    dc.decode_core_mgpu(kc, vs.token_contiguous(vc), qd, qs, interpret=True)
  with pytest.raises(ValueError, match="qd"):
    dc.decode_core_mgpu(kc, vc, qd[:, :4], qs, interpret=True)
  with pytest.raises(ValueError, match="splits"):
    dc.decode_core_mgpu(kc, vc, qd, qs, block_s=64, splits=3, interpret=True)
  with pytest.raises(ValueError, match="block_s"):
    dc.decode_core_mgpu(kc, vc, qd, qs, block_s=32, interpret=True)
  kout, vout, qo = _outliers(0, 1, 256)
  with pytest.raises(ValueError, match="go together"):
    dc.decode_core_mgpu(kc, vc, qd, qs, None, kout, splits=2, interpret=True)
  with pytest.raises(ValueError, match="tokens contiguous"):
    dc.decode_core_mgpu(kc, vc, qd, qs, None, kout, jnp.swapaxes(vout, 1, 2), qo, splits=2, interpret=True)
  with pytest.raises(ValueError, match="qo"):
    dc.decode_core_mgpu(kc, vc, qd, qs, None, kout, vout, qo.astype(jnp.float32), splits=2, interpret=True)
  with pytest.raises(ValueError, match="lengths"):
    dc.decode_core_mgpu(kc, vc, qd, qs, jnp.zeros((2,), jnp.int32), splits=2, interpret=True)
  vcb, voutb = vl.block_major(vc), vl.block_major(vout)
  with pytest.raises(ValueError, match="block_s=64: block-major"):
    dc.decode_core_mgpu(kc, vcb, qd, qs, block_s=64, splits=2, interpret=True)
  with pytest.raises(ValueError, match="share a layout"):
    dc.decode_core_mgpu(kc, vcb, qd, qs, None, kout, vout, qo, block_s=128, splits=2, interpret=True)
  with pytest.raises(ValueError, match=r"vcodes \(1, 2, 16, 256\)"):
    dc.decode_core_mgpu(kc, vcb.reshape(1, 2, 16, 256), qd, qs, block_s=128, splits=2, interpret=True)
  with pytest.raises(ValueError, match="vout"):
    dc.decode_core_mgpu(kc, vcb, qd, qs, None, kout, voutb[:, :1], qo, block_s=128, splits=2, interpret=True)
