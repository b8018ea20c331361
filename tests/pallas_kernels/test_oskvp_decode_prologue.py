"""The bit-plane kernel's Pallas query prologue (CPU interpret mode) vs its jnp reference
(`prepare_bitplane_query` + `compact_query`).

Tolerances: scales and the codebook term are f32 sums in a different order (relative 1e-5); the bf16 query planes
may differ by one unit in the last place; the outlier queries by one bf16 unit (the reference rounds them to bf16
before f16, the prologue rounds the f32 value to f16 once); an int8 digit may differ by one where the value
sits within f32 rounding of a rounding boundary (at most 0.5% of the digits here), and the value the digits
encode, qs (hi + lo / 256), stays within qs / 256 of the reference's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.oskvp_decode_attention_bitplane import compact_query, prepare_bitplane_query
from pallas_kernels.oskvp_decode_prologue import compact_query_pallas
from pallas_kernels.oskvp_random import random_oskvp_inputs_host as random_oskvp_inputs


@functools.partial(jax.jit, static_argnames=("kh", "groups", "rows", "o_cols", "digits", "types"))
def _reference(q, u_k, cb_k, scale_k, *, kh, groups, rows, o_cols, digits, types):
  """The jnp reference as one program (op by op, it compiles a program per operation)."""
  qhi, qlo, qs, qc_r, qp_r, qo_r = prepare_bitplane_query(q, u_k, cb_k, scale_k, kh, 1, rows, o_cols, digits, types)
  qd_r, qw_r, qc_r = compact_query(qhi, qlo, qs, qc_r, groups, digits)
  return qd_r, qw_r, qc_r, qp_r[:, :, :, 0], qo_r[:, :, 0].astype(jnp.float16)


@pytest.mark.parametrize("groups,outliers,symmetric,digits,key_bits",
                         [(4, 8, False, 2, 2), (8, 12, True, 2, 2), (1, 8, False, 1, 2), (4, 8, False, 2, 3),
                          (8, 8, True, 2, 3)])
def test_prologue_matches_reference(groups, outliers, symmetric, digits, key_bits):
  """key_bits=3: 8-level key codebooks, seven plane types (four if symmetric)."""
  kh, rows, o_cols = 2, 16, 16
  args = random_oskvp_inputs(5 + groups, batch=2, heads=kh * groups, kv_heads=kh, head_dim=128, capacity=8, window=8,
                             outliers=outliers, symmetric=symmetric, key_bits=key_bits)
  q, _, _, scale_k, cb_k, *_, u_k = args[:10]
  types = {(3, False): 7, (3, True): 4, (2, False): 3, (2, True): 2}[(key_bits, symmetric)]
  qd, qw, qc, qp, qo = compact_query_pallas(q, u_k, cb_k, scale_k, rows=rows, o_cols=o_cols, types=types,
                                            digits=digits, outlier_dtype=jnp.float16, interpret=True)
  qd_r, qw_r, qc_r, qp_r, qo_r = _reference(q, u_k, cb_k, scale_k, kh=kh, groups=groups, rows=rows, o_cols=o_cols,
                                            digits=digits, types=types)
  assert qd.shape == qd_r.shape and qd.dtype == jnp.int8
  np.testing.assert_allclose(qw, qw_r, rtol=1e-5, atol=0)
  np.testing.assert_allclose(qc, qc_r, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(qp, np.float32), np.asarray(qp_r, np.float32), rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(qo, np.float32), np.asarray(qo_r, np.float32), rtol=2**-8, atol=1e-6)
  qd, qd_r = np.asarray(qd, np.int32), np.asarray(qd_r, np.int32)
  assert np.abs(qd - qd_r).max() <= 1 and (qd != qd_r).mean() < 5e-3
  # Rows >= 2G (>= G with one digit) are zero padding in both.
  used = groups * digits
  assert not qd[..., used:, :].any() and not np.asarray(qw)[..., used:].any()
  # The encoded value: sum over the row groups of digit x row scale.
  qw, qw_r = np.asarray(qw), np.asarray(qw_r)

  def value(d, w):
    x = d * w[:, :, None, None, :, None]
    return x.reshape(*x.shape[:4], rows // groups, groups, x.shape[-1]).sum(axis=4)

  step = np.asarray(qw_r)[:, :, None, None, :groups, None] / (256.0 if digits == 2 else 1.0)
  assert (np.abs(value(qd, qw) - value(qd_r, qw_r)) <= step * 1.01).all()


def test_prologue_rejects_two_digits_without_room():
  args = random_oskvp_inputs(1, batch=1, heads=16, kv_heads=1, head_dim=128, capacity=8, window=8)
  q, _, _, scale_k, cb_k, *_, u_k = args[:10]
  with pytest.raises(ValueError, match="2 G <= rows"):
    compact_query_pallas(q, u_k, cb_k, scale_k, rows=16, o_cols=16, types=3, digits=2, outlier_dtype=jnp.float16,
                         interpret=True)
