"""The warp-level (mma.sync) OS-KVP core: its numpy model of the GPU route against the XLA model, the fragment
invariant it rests on, the lowering for CUDA, argument errors. (The kernel runs on GPUs only:
benchmarks/oskvp_decode_core_mma_bench.py checks it there.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import oskvp_core_registers_mgpu as rg
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_decode_core_mma as dm
from pallas_kernels import oskvp_decode_core_mma_model as dmm
from pallas_kernels import oskvp_value_sums_mgpu as vs
from pallas_kernels.mosaic_gpu_introspect import mosaic_module_text

Q = dm.Q


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _inputs(seed, bk, s, g=4, scale=0.004):
  k = jax.random.split(jax.random.key(seed), 6)
  kc = jax.random.bits(k[0], (bk, s, Q), jnp.uint8)
  vc = jax.random.bits(k[1], (bk, Q, s), jnp.uint8)
  qd = jax.random.randint(k[2], (bk, dm.N, 4 * Q), -127, 128).astype(jnp.int8).at[:, g:].set(0)
  kout = (jax.random.normal(k[3], (bk, s, dm.OUTLIERS)) * 2).astype(jnp.float8_e4m3fn)
  vout = (jax.random.normal(k[4], (bk, dm.OUTLIERS, s)) * 2).astype(jnp.float8_e4m3fn)
  qo = (jax.random.normal(k[5], (bk, dm.N, dm.OUTLIERS)) * 0.3).at[:, g:].set(0).astype(jnp.float16)
  return kc, vc, qd, jnp.full((bk, dm.N), scale, jnp.float32), kout, vout, qo


@pytest.mark.parametrize("bk,s,splits,lengths,outliers,g,key_rows", [(1, 512, 2, None, False, 4, "heads"),
                                                                     (2, 512, 1, (1, 300), True, 8, "heads"),
                                                                     (2, 256, 2, (0, 129), True, 4, "heads"),
                                                                     (1, 512, 2, None, False, 4, "tokens"),
                                                                     (2, 256, 1, (1, 200), True, 8, "tokens"),
                                                                     (2, 512, 2, (32, 256), True, 1, "tokens"),
                                                                     (2, 512, 4, (128, 0), False, 4, "tokens"),
                                                                     (1, 256, 1, None, True, 4, "tokens")])
def test_gpu_route_model_matches_the_xla_model(bk, s, splits, lengths, outliers, g, key_rows):
  """The numpy model runs the kernel's index math (code, outlier sources, n-tile columns, packing, stores) on the
  PTX fragment layouts: equal to the XLA model of 32-token warp blocks to f32 rounding (a wrong index is O(0.1))."""
  kc, vc, qd, qs, kout, vout, qo = _inputs(bk * s + g, bk, s, g)
  args = (kc, vc, qd, qs, None if lengths is None else jnp.asarray(lengths, jnp.int32))
  if outliers:
    args += (kout, vout, qo)
  got = dmm.emulate(*args, splits=splits, key_rows=key_rows)
  want = dm.decode_core_mma_reference(*args, splits=splits)
  got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)
  if lengths is not None and lengths[0] == 0:
    assert not np.asarray(got[0][0]).any()  # a row without tokens: zeros


def test_the_key_scores_accumulator_is_the_value_sums_operand():
  """Thread (g, t) holds columns 2t, 2t + 1 of each key n-tile; with `key_token` those are tokens 4t..4t+3 (n-tiles
  0, 1, in byte order) and 16+4t..16+4t+3 (n-tiles 2, 3): the B fragment of the value sums, no data moved."""
  for t in range(4):
    toks = [dm.key_token(rg.Ints, nt, 2 * t + e) for nt in range(4) for e in range(2)]
    assert toks == [4 * t, 4 * t + 1, 4 * t + 2, 4 * t + 3, 16 + 4 * t, 17 + 4 * t, 18 + 4 * t, 19 + 4 * t]
  cols = sorted(dm.key_token(rg.Ints, nt, n) for nt in range(4) for n in range(8))
  assert cols == list(range(32))  # every token of the warp scored once


def test_output_rows_are_the_wgmma_cores_acc_order():
  """The kernel stores channel ch at row acc_row(ch): the wgmma core's ACC order, so that the wired path's
  epilogue reads either core's output."""
  rows = [dm.acc_row(rg.Ints, ch) for ch in range(4 * Q)]
  assert sorted(rows) == list(range(4 * Q))
  np.testing.assert_array_equal(vs.acc_row_channels(Q)[rows], np.arange(4 * Q))


def test_warp_order_and_the_model_against_the_exact_softmax():
  order = dm.warp_order(1024, 2)
  assert sorted(order) == list(range(1024))
  assert list(order[:34]) == [*range(32), 128, 129]  # split 0, warp 0: tokens 0..31, then 128.. of the next step
  # peaked attention (large scale): the 127-level p is exact to ~1e-3, as for the wgmma core's model
  kc, vc, qd, _, kout, vout, qo = _inputs(3, 2, 1024)
  qs = jnp.full((2, dm.N), 0.05, jnp.float32)
  got = dm.decode_core_mma_reference(kc, vc, qd, qs, None, kout, vout, qo, splits=2)
  exact = dc.decode_core_reference(kc, vc, qd, qs, None, kout, vout, qo)
  np.testing.assert_allclose(np.asarray(got[0][:, :4]), np.asarray(exact[0][:, :4]), atol=3e-3)


def _abstract(s, bk=2):
  sd = jax.ShapeDtypeStruct
  return (sd((bk, s, Q), jnp.uint8), sd((bk, Q, s), jnp.uint8), sd((bk, dm.N, 4 * Q), jnp.int8),
          sd((bk, dm.N), jnp.float32), sd((bk,), jnp.int32), sd((bk, s, 8), jnp.float8_e4m3fn),
          sd((bk, 8, s), jnp.float8_e4m3fn), sd((bk, dm.N, 8), jnp.float16))


@pytest.mark.parametrize("key_rows,n_key,n_key_outlier,n_movmatrix", [("heads", 16, 4, 0), ("tokens", 8, 2, 4)])
def test_gpu_route_lowers(key_rows, n_key, n_key_outlier, n_movmatrix):
  """Per 128-token step each warp issues its key-score s8 mma.sync (16 with the heads as rows, 8 with the tokens),
  8 u8 value ones (planes masked in place, `value_plane`), the outliers' f16 ones (m16n8k8 keys, 2 m16n8k16 values), one vote, and with the tokens as rows 4
  movmatrix transposes of p; no wgmma and no store of p to shared memory."""
  kc, vc, qd, qs, ln, ko, vo, qo = _abstract(2048)
  for args, n_f16 in (((kc, vc, qd, qs), 0), ((kc, vc, qd, qs, ln, ko, vo, qo), 1)):
    text = mosaic_module_text(jax.jit(lambda *a: dm.decode_core_mma(*a, splits=2, key_rows=key_rows)).trace(*args)
                              .lower(lowering_platforms=("cuda",)))
    loop = text[text.index("scf.for"):]
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.s8\.s8\.s32", loop)) == n_key
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.u8\.u8\.s32", loop)) == 8
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.f16", loop)) == n_key_outlier * n_f16
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16", loop)) == 2 * n_f16
    assert len(re.findall(r"movmatrix\.sync\.aligned\.m8n8\.trans\.b16", loop)) == n_movmatrix
    assert len(re.findall(r"vote\.sync\.any", loop)) == 1
    assert "wgmma" not in text


def test_gpu_route_lowers_block_major_values():
  """Block-major value codes and outliers (`oskvp_value_layout`) lower to the same mma.sync loop, the TMA source
  being the [BK, S/128 · X, 128] view instead of [BK, X, S]; a layout the two do not share is refused."""
  kc, vc, qd, qs, ln, ko, vo, qo = _abstract(2048)
  vcb, vob = (jax.ShapeDtypeStruct((2, 16, x, 128), d) for x, d in ((Q, jnp.uint8), (dm.OUTLIERS, vo.dtype)))
  lower = lambda *a: mosaic_module_text(jax.jit(lambda *a: dm.decode_core_mma(*a, splits=2)).trace(*a)
                                        .lower(lowering_platforms=("cuda",)))
  tokens, blocks = lower(kc, vc, qd, qs, ln, ko, vo, qo), lower(kc, vcb, qd, qs, ln, ko, vob, qo)
  mma = lambda text: sorted(re.findall(r"mma\.sync\.aligned\.[a-z0-9.]+", text[text.index("scf.for"):]))
  assert mma(blocks) == mma(tokens) and len(mma(blocks)) > 16
  assert "memref<2x512x128xi8>" in blocks and "memref<2x128x128xf8E4M3FN>" in blocks
  assert "memref<2x32x2048xi8>" not in blocks and "memref<2x32x2048xi8>" in tokens
  with pytest.raises(ValueError, match="share a layout"):
    jax.eval_shape(functools.partial(dm.decode_core_mma, splits=2), kc, vcb, qd, qs, ln, ko, vo, qo)


def test_rejects_bad_arguments():
  kc, vc, qd, qs, kout, vout, qo = _inputs(0, 1, 256)
  with pytest.raises(ValueError, match="H = 128"):
    dm.decode_core_mma(jnp.concatenate([kc, kc], -1), jnp.concatenate([vc, vc], 1), jnp.concatenate([qd, qd], -1),
                       qs, splits=1)  # H = 256
  with pytest.raises(ValueError, match="key_rows"):
    dm.decode_core_mma(kc, vc, qd, qs, splits=1, key_rows="channels")
  with pytest.raises(ValueError, match="ablate"):
    dm.decode_core_mma(kc, vc, qd, qs, splits=1, ablate="no_max")
  with pytest.raises(ValueError, match="go together"):
    dm.decode_core_mma(kc, vc, qd, qs, None, kout, splits=1)
  with pytest.raises(ValueError, match="splits"):
    dm.decode_core_mma(kc, vc, qd, qs, splits=3)
  with pytest.raises(ValueError, match="kout"):
    dm.decode_core_mma(kc, vc, qd, qs, None, kout.astype(jnp.bfloat16), vout, qo, splits=1)
  with pytest.raises(ValueError, match="lengths"):
    dm.decode_core_mma(kc, vc, qd, qs, jnp.ones((1,), jnp.float32), splits=1)
  qs_row = dc.padded_scales(qs, jnp.full((1,), 256, jnp.int32), 256)
  qo16 = jnp.pad(qo, ((0, 0), (0, 0), (0, 8)))
  with pytest.raises(ValueError, match="key_rows"):
    dm.decode_core_mma_splits(kc, vc, qd, qs_row, kout, vout, qo16, splits=1, key_rows="token")
  with pytest.raises(ValueError, match="qo16 is float32"):
    dm.decode_core_mma_splits(kc, vc, qd, qs_row, kout, vout, qo16.astype(jnp.float32), splits=1)
  long = 256 * (dm.MAX_SPLIT_TOKENS // 256 + 1)  # one program past the value sums' int32 range (`value_plane`)
  with pytest.raises(ValueError, match="overflow"):
    jax.eval_shape(functools.partial(dm.decode_core_mma, splits=1), *_abstract(long)[:4])
  jax.eval_shape(functools.partial(dm.decode_core_mma, splits=2), *_abstract(long)[:4])  # two programs: fine
