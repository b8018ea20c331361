"""OS-KVP decode attention with 3-bit keys (`hi_k`, `OSKVPMode(key_bits=3)`): the compact bit-plane kernel in CPU
interpret mode vs the plain-jnp reference, which is itself checked against a hand decode of the bit layout.

As in `test_oskvp_decode_attention.py`: fresh random caches, dynamic lengths, partial outputs poisoned with NaN,
relative L2 error per batch row <= 1.5e-2 (the int8 digits of the query and probabilities, as bf16). Each case also
checks the error is far below what reading the keys as 2-bit codes would give (so the third bit is really read).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from pallas_kernels.oskvp_decode_attention import (BITPLANE, TWO_DOT_BITPLANE, DecodeBlockConfig, _oskvp_pallas,
                                                   dequantize_rotated, oskvp_decode_attention,
                                                   oskvp_decode_attention_reference, supports_key_high_bits)
from pallas_kernels.oskvp_decode_attention_bitplane import (codebook_deltas, key_plane_coefficients,
                                                            multilinear_coefficients)
from pallas_kernels.oskvp_random import random_oskvp_inputs_host as random_oskvp_inputs

TOL = 1.5e-2


def rel_err(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def run_case(seed, config, symmetric=False, **shape):
  *args, hi_k = random_oskvp_inputs(seed, key_bits=3, symmetric=symmetric, **shape)
  ref = oskvp_decode_attention_reference(*args, hi_k=hi_k)
  out = _oskvp_pallas(*args, hi_k, interpret=True, config=config, poison=True, symmetric_codebooks=symmetric)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  per_row = [rel_err(out[b], ref[b]) for b in range(out.shape[0])]
  assert max(per_row) < TOL, per_row
  # The same store read as 2-bit keys (third bits dropped) is far off: the kernel's agreement is not by chance.
  two_bit = oskvp_decode_attention_reference(*args[:4], args[4][..., :4], *args[5:])
  assert rel_err(two_bit, ref) > 10 * max(per_row)
  return out, ref


def test_multilinear_coefficients_rebuild_every_codebook_entry():
  """cb[c] = sum over bit sets m of c's bits of a_m, for 8 and 4 levels; 4 levels are `codebook_deltas`."""
  cb = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 8)), jnp.float32)  # [.., H, L]
  a = np.asarray(multilinear_coefficients(cb))  # [.., L, H]
  for c in range(8):
    subsets = [m for m in range(8) if m & c == m]
    np.testing.assert_allclose(sum(a[..., m, :] for m in subsets), cb[..., c], atol=1e-5)
  np.testing.assert_allclose(multilinear_coefficients(cb[..., :4]), codebook_deltas(cb[..., :4]), atol=1e-6)


def test_symmetric_coefficients_rebuild_every_entry_of_a_symmetric_row():
  """Symmetric 8-level rows (cb[c] + cb[7 - c] constant): cb[c] = c0 + d0 b0 + d1 b1 + d2 b2 + dp (b0 ^ b1 ^ b2); a
  row that is not symmetric is not rebuilt (the form needs the symmetry)."""
  rng = np.random.default_rng(1)
  free = np.sort(rng.standard_normal((3, 6, 8)), axis=-1).astype(np.float32)
  sym = free.mean(axis=-1, keepdims=True) + 0.5 * (free - free[..., ::-1])

  def rebuilt(cb):
    a = np.asarray(key_plane_coefficients(jnp.asarray(cb), 4))  # [.., 5, H]
    out = []
    for c in range(8):
      b0, b1, b2 = c & 1, (c >> 1) & 1, (c >> 2) & 1
      bits = (1, b0, b1, b2, b0 ^ b1 ^ b2)
      out.append(sum(a[..., i, :] * bit for i, bit in enumerate(bits)))
    return np.stack(out, axis=-1)

  np.testing.assert_allclose(rebuilt(sym), sym, atol=1e-5)
  assert np.abs(rebuilt(free) - free).max() > 1e-2
  np.testing.assert_allclose(key_plane_coefficients(jnp.asarray(free), 7), multilinear_coefficients(free), atol=1e-6)


def test_reference_reads_the_third_bit_in_pack1_layout():
  """dequantize_rotated with hi_k against a hand decode: channel p Q + i is byte i's bits 2p..2p+1 of codes_k plus
  4 x bit m of byte i' of hi_k, with channel = m H/8 + i'."""
  b, kh, h, s = 1, 2, 128, 9
  *args, hi_k = random_oskvp_inputs(3, batch=b, heads=2, kv_heads=kh, head_dim=h, capacity=s, window=4, key_bits=3)
  ck, ok, sk, cbk = (np.asarray(x.astype(jnp.float32)) if x.dtype != jnp.uint8 else np.asarray(x) for x in args[1:5])
  hk = np.asarray(hi_k)
  qq, eighth = h // 4, h // 8
  want = np.zeros((b, kh, s, h), np.float32)
  for j in range(h):
    code = (ck[..., j % qq] >> (2 * (j // qq))) & 3
    code = code + 4 * ((hk[..., j % eighth] >> (j // eighth)) & 1)
    want[..., j] = np.take_along_axis(cbk[:, :, j][:, :, None, :], code[..., None].astype(np.int64), axis=-1)[..., 0]
  want[..., :8] += ok * sk[:, :, None, :]
  np.testing.assert_allclose(np.asarray(dequantize_rotated(args[1], args[2], args[3], args[4], hi_k)), want,
                             rtol=1e-6, atol=1e-6)


def test_mixed_lengths_g4():
  """Lengths 1, 127 and 1000 in one batch, partly filled windows (one empty), the GPU default tiling."""
  run_case(31, dataclasses.replace(BITPLANE, num_splits=3), batch=3, heads=8, kv_heads=2, head_dim=128,
           capacity=1000, window=48, n_comp=[1, 127, 1000], n_res=[0, 17, 48])


def test_long_g1_and_g8_empty_store():
  """4097 tokens at G = 1 (default splits); G = 8 with an empty store, 12 outlier channels and the jnp extraction;
  G = 4 with the XLA value merge and one query digit."""
  run_case(32, BITPLANE, batch=1, heads=2, kv_heads=2, head_dim=128, capacity=4097, window=128, n_comp=[4097],
           n_res=[100])
  run_case(33, dataclasses.replace(BITPLANE, block_s=64, num_splits=5, extract="jnp"), batch=2, heads=16,
           kv_heads=2, head_dim=128, capacity=700, window=16, outliers=12, n_comp=[0, 700], n_res=[9, 16])
  run_case(34, dataclasses.replace(BITPLANE, block_s=64, num_splits=2, values_in_kernel=False, query_digits=1,
                                   pallas_prologue=False), batch=1, heads=8, kv_heads=2, head_dim=128, capacity=300,
           window=16, n_comp=[300], n_res=[5])


def test_symmetric_codebooks_four_key_plane_types():
  """Symmetric 8-level key and 4-level value codebooks (`oskvp_k3v2_sym`): G = 4 mixed lengths with the default
  tiling and the Pallas prologue; G = 8 with an empty store and the XLA prologue."""
  run_case(35, dataclasses.replace(BITPLANE, num_splits=3), symmetric=True, batch=3, heads=8, kv_heads=2,
           head_dim=128, capacity=700, window=48, n_comp=[1, 127, 700], n_res=[0, 17, 48])
  run_case(36, dataclasses.replace(BITPLANE, block_s=64, num_splits=4, pallas_prologue=False), symmetric=True,
           batch=2, heads=16, kv_heads=2, head_dim=128, capacity=300, window=16, n_comp=[0, 300], n_res=[9, 16])


@pytest.mark.parametrize("symmetric", [False, True])
def test_matches_kv_quant_on_a_real_key_bits_3_cache(symmetric):
  """A cache quantized by moe_jax (`OSKVPMode(key_bits=3)`, head dim 128): the kernel, through kv_quant's own entry
  point, matches kv_quant's XLA decode attention on it (the two packages agree on the bit layout); with
  `symmetric=True` (`oskvp_k3v2_sym`) the fitted codebooks are symmetric, as the kernel's four-type form needs."""
  oskvp_modes = pytest.importorskip("moe_jax.kv_quant.oskvp_modes")
  oskvp_attention = pytest.importorskip("moe_jax.kv_quant.oskvp_attention")
  rng = np.random.default_rng(9)
  b, t, kh, n, h = 2, 160, 2, 8, 128
  chan = np.where(np.arange(h) < 5, 6.0, 1.0).astype(np.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kh, h), np.float32) * chan + 0.3)
  v = jnp.asarray(rng.standard_normal((b, t, kh, h), np.float32))
  lengths = jnp.asarray([160, 61], jnp.int32)
  mode = oskvp_modes.OSKVPMode(window=32, n_iters=4, key_bits=3, symmetric=symmetric)
  cache = jax.jit(lambda k, v, lengths: mode.from_prefill(k, v, lengths, 192, layer=0))(k, v, lengths)
  assert cache.hi_k is not None and cache.hi_v is None and cache.cb_k.shape[-1] == 8
  if symmetric:
    oskvp = pytest.importorskip("moe_jax.kv_quant.oskvp")
    assert cache.symmetric and oskvp.symmetric_codebooks(cache.cb_k) and oskvp.symmetric_codebooks(cache.cb_v)
  q = jnp.asarray(rng.standard_normal((b, n, h), np.float32)).astype(jnp.bfloat16)
  args = (q, cache.codes_k, cache.outl_k, cache.scale_k, cache.cb_k, cache.codes_v, cache.outl_v, cache.scale_v,
          cache.cb_v, cache.u_k, cache.u_v, cache.res_k, cache.res_v, cache.n_comp, cache.n_res)
  theirs = oskvp_attention.oskvp_decode_attention_xla(*args, hi_k=cache.hi_k)
  ours = oskvp_attention.oskvp_decode_attention(*args, hi_k=cache.hi_k, implementation="pallas", interpret=True,
                                                symmetric_codebooks=symmetric)
  assert rel_err(ours, theirs) < TOL


def test_entry_point_validates_hi_k_and_falls_back_where_unsupported():
  *args, hi_k = random_oskvp_inputs(5, batch=1, heads=4, kv_heads=1, head_dim=128, capacity=16, window=16,
                                    key_bits=3)
  with pytest.raises(ValueError, match="hi_k must have shape"):
    oskvp_decode_attention(*args, hi_k=hi_k[..., :8], interpret=True)
  with pytest.raises(ValueError, match="hi_k must be uint8"):
    oskvp_decode_attention(*args, hi_k=hi_k.astype(jnp.int8), interpret=True)
  with pytest.raises(ValueError, match="cb_k must have shape"):  # 4-level key codebooks with third bits
    oskvp_decode_attention(*args[:4], args[4][..., :4], *args[5:], hi_k=hi_k, interpret=True)
  for config in (DecodeBlockConfig(), TWO_DOT_BITPLANE):  # "mma" (head dim 64's default) and G = 16's default
    with pytest.raises(ValueError, match="hi_k"):
      oskvp_decode_attention(*args, hi_k=hi_k, interpret=True, config=config)
  assert supports_key_high_bits(128, 4) and supports_key_high_bits(128, 8) and supports_key_high_bits(256, 1)
  for h, g in ((64, 4), (128, 16), (128, 6), (160, 4), (192, 4)):  # "mma", two dots, non-power-of-two G / tiles
    assert not supports_key_high_bits(h, g), (h, g)


def test_kv_quant_dispatch_falls_back_to_xla_where_the_kernel_cannot_read_the_keys():
  """G = 6 (not a power of two): `implementation="pallas"` answers through the XLA reference instead of raising."""
  oskvp_attention = pytest.importorskip("moe_jax.kv_quant.oskvp_attention")
  *args, hi_k = random_oskvp_inputs(6, batch=1, heads=12, kv_heads=2, head_dim=128, capacity=40, window=8,
                                    key_bits=3)
  out = oskvp_attention.oskvp_decode_attention(*args, hi_k=hi_k, implementation="pallas", interpret=True)
  assert rel_err(out, oskvp_attention.oskvp_decode_attention_xla(*args, hi_k=hi_k)) < 1e-6


@pytest.mark.parametrize("symmetric", [False, True])
def test_lowers_to_triton_ir_for_hopper(symmetric):
  """The real kernel, with the gathered load of the third bits, lowers to Triton IR for an H100-class GPU."""
  *args, hi_k = random_oskvp_inputs(7, batch=2, heads=8, kv_heads=2, head_dim=128, capacity=300, window=128,
                                    key_bits=3, symmetric=symmetric)
  fn = functools.partial(_oskvp_pallas, interpret=False, config=BITPLANE, symmetric_codebooks=symmetric)
  assert lowers_to_triton_for_hopper(lambda *a: fn(*a[:15], a[15]), *args, hi_k)
