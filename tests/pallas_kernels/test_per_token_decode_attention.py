"""Split-K decode attention over per-token 8-bit caches (Triton interpret mode on CPU) vs the f32 reference and vs
`moe_jax.kv_quant.per_token`'s own quantizer and dense attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hopper_lowering import lowers_to_triton_for_hopper  # pylint: disable=import-error
from moe_jax.kv_cache import decode_attention_reference
from moe_jax.kv_quant.per_token import dequantize_per_token, quantize_per_token
from pallas_kernels import per_token_decode_attention as pt


@functools.partial(jax.jit, static_argnums=range(1, 7))
def _inputs(seed, b, s, kh, g, h, dtype):
  """One program per shape (op by op, the draws and the quantizer compile a program per operation)."""
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, kh * g, h), jnp.float32)
  k = jax.random.normal(ks[1], (b, s, kh, h)) * 2.0
  v = jax.random.normal(ks[2], (b, s, kh, h))
  (kq, k_scale), (vq, v_scale) = quantize_per_token(k, dtype), quantize_per_token(v, dtype)
  return q, kq, vq, k_scale, v_scale


# (lengths, K, G, H, block_s, splits): lengths 1, 127, 1000, 4097 and mixed batches; G 1/4/8 (16 rows of which G
# real); H 64/128; splits with no tokens (short rows over many splits).
CASES = [
    ([1, 127, 1000], 2, 4, 64, 64, 3),
    ([4097], 1, 8, 128, 128, 4),
    ([5, 300], 2, 1, 64, 16, 8),
    ([64, 65, 0], 1, 4, 128, 64, None),
]


@pytest.mark.parametrize("dtype", pt.DTYPES)
@pytest.mark.parametrize("lengths,kh,g,h,block_s,splits", CASES)
def test_matches_reference(lengths, kh, g, h, block_s, splits, dtype):
  """Within 1e-2 of the largest output (bf16 q and p·v_scale; measured 2e-3 to 4e-3), rows of length 0 are zero."""
  s = max(max(lengths), 1) + 3  # capacity past the longest row: masked tokens must not count
  q, k, v, k_scale, v_scale = _inputs(len(lengths) + h + g, len(lengths), s, kh, g, h, dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  got = np.asarray(pt.per_token_decode_attention(q, k, v, k_scale, v_scale, lengths, block_s=block_s,
                                                 num_splits=splits, interpret=True))
  want = np.asarray(pt.per_token_decode_attention_reference(q, k, v, k_scale, v_scale, lengths))
  live = np.asarray(lengths) > 0
  assert np.isfinite(got[live]).all()
  np.testing.assert_allclose(got[live], want[live], atol=1e-2 * np.abs(want[live]).max())
  if not live.all():
    assert not np.any(got[~live]), "a row with no visible key must give zeros"


def test_reference_equals_the_cache_quantizer_and_dense_attention():
  """The reference is dense attention over `per_token`'s own dequantized cache (the XLA path of `decode_step`)."""
  q, k, v, k_scale, v_scale = _inputs(3, 2, 50, 2, 4, 64, "int8")
  lengths = jnp.asarray([17, 50], jnp.int32)
  dense = jax.jit(lambda q, k, v, k_scale, v_scale, lengths: decode_attention_reference(  # one program, not one per op
      q, dequantize_per_token(k, k_scale), dequantize_per_token(v, v_scale), lengths))
  want = dense(q, k, v, k_scale, v_scale, lengths)
  got = pt.per_token_decode_attention(q, k, v, k_scale, v_scale, lengths, implementation="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_lowers_to_triton_ir_for_hopper():
  for dtype in pt.DTYPES:
    args = (*_inputs(0, 2, 256, 2, 4, 128, dtype), jnp.asarray([100, 256], jnp.int32))
    assert lowers_to_triton_for_hopper(functools.partial(pt.per_token_decode_attention, interpret=False), *args)


def test_rejects_bad_arguments():
  q, k, v, k_scale, v_scale = _inputs(0, 2, 32, 2, 4, 64, "int8")
  lengths = jnp.asarray([3, 4], jnp.int32)
  call = functools.partial(pt.per_token_decode_attention, interpret=True)
  with pytest.raises(ValueError, match="k, v dtype"):
    call(q, k.astype(jnp.float32), v, k_scale, v_scale, lengths)
  with pytest.raises(ValueError, match="k_scale"):
    call(q, k, v, k_scale[:, :-1], v_scale, lengths)
  with pytest.raises(ValueError, match="kv heads"):
    call(q[:, :7], k, v, k_scale, v_scale, lengths)
  with pytest.raises(ValueError, match="lengths"):
    call(q, k, v, k_scale, v_scale, lengths[:1])
  with pytest.raises(ValueError, match="block_s"):
    call(q, k, v, k_scale, v_scale, lengths, block_s=48)
  with pytest.raises(ValueError, match="implementation"):
    call(q, k, v, k_scale, v_scale, lengths, implementation="cuda")
  # Before: failed in Triton's lowering (a 24-row query tile), ran truncating float lengths (the reference does
  # not), failed inside Pallas' interpreter (an empty cache) or numpy (num_splits=-1).
  with pytest.raises(ValueError, match="G = N / K = 24 query heads per kv head must be <= 16 or a power of two"):
    call(jnp.zeros((2, 48, 64)), k, v, k_scale, v_scale, lengths)
  with pytest.raises(ValueError, match="lengths must be an integer array"):
    call(q, k, v, k_scale, v_scale, lengths.astype(jnp.float32))
  with pytest.raises(ValueError, match="S=0: the kernel needs at least one slot"):
    call(q, k[:, :0], v[:, :0], k_scale[:, :0], v_scale[:, :0], lengths)
  with pytest.raises(ValueError, match="num_splits=-1 must be None or an int >= 1"):
    call(q, k, v, k_scale, v_scale, lengths, num_splits=-1)


def test_refuses_caches_the_triton_offsets_cannot_index():
  """k of 32 × 131072 × 8 × 128 int8 (2^32 elements; an illegal address on the H200) is refused by the kernel path
  at trace time, naming the input; the XLA path still takes it."""
  b, s, kh, h = 32, 131072, 8, 128
  big = jax.ShapeDtypeStruct((b, s, kh, h), jnp.int8)
  args = (jax.ShapeDtypeStruct((b, 32, h), jnp.bfloat16), big, big, jax.ShapeDtypeStruct((b, s, kh), jnp.float32),
          jax.ShapeDtypeStruct((b, s, kh), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
  with pytest.raises(ValueError, match=r"^k \(32, 131072, 8, 128\) int8 has 4294967296 >= 2\^31 elements"):
    jax.eval_shape(pt.per_token_decode_attention, *args)
  assert jax.eval_shape(functools.partial(pt.per_token_decode_attention, implementation="xla"), *args).shape == (
      b, 32, h)
