"""Weight quantizers (int4 RTN / AWQ / 2:4, vq2) and their use in the model: errors, layouts, bytes, I/O."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import decode
from moe_jax import quant
from moe_jax.quant import kernels

E, K, N = 2, 256, 64


def _w(seed=0):
  return jax.random.normal(jax.random.key(seed), (E, K, N), jnp.float32)


def test_int4_rtn_error_within_one_step():
  w = _w()
  q = quant.quantize_int4(w)
  err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
  step = np.repeat(np.asarray(q.data.scale, np.float32), 128, axis=1)  # [E, K, N]
  assert np.all(err <= step * 1.001)  # round to nearest, plus at most half a step from the rounded zero point
  rel = np.linalg.norm(err) / np.linalg.norm(np.asarray(w))
  assert rel < 0.12, rel
  assert q.bits_per_weight() == pytest.approx(4 + 24 / 128)


def test_int4_sp24_keeps_two_of_four_and_saves_bytes():
  w = _w(1)
  q = quant.quantize_int4(w, sparsity="2:4")
  wh = np.asarray(q.dequantize()).reshape(E, K // 128, 4, 32, N)  # slot j of quad r at k = r + 32 j
  assert np.all(np.sum(wh == 0, axis=2) >= 2)
  assert q.bits_per_weight() == pytest.approx(3 + 24 / 128)
  # The kept weights are the larger two of each quad (no calibration: magnitude saliency).
  kept = np.asarray(quant.int4.prune_24(w, 128)).reshape(E, K // 128, 4, 32, N)
  mag = np.abs(np.asarray(w)).reshape(E, K // 128, 4, 32, N)
  assert np.all(np.min(np.where(kept, mag, np.inf), axis=2) >= np.max(np.where(kept, -np.inf, mag), axis=2))


def test_awq_beats_rtn_on_outlier_channels():
  w = _w(2)
  scale = jnp.ones((K,)).at[:8].set(30.0)  # a few input channels carry large activations
  x = jax.random.normal(jax.random.key(3), (E, 64, K)) * scale
  err = {}
  for awq in (False, True):
    q = quant.quantize_int4(w, calib_x=x, awq=awq)
    err[awq] = float(jnp.linalg.norm(jnp.einsum("ERK,EKN->ERN", x, q.dequantize() - w)))
  assert err[True] < 0.8 * err[False], err


def test_vq2_error_bits_and_codebooks():
  w = _w(4)
  q = quant.quantize_vq2(w, iters=10)
  rel = float(jnp.linalg.norm(q.dequantize() - w) / jnp.linalg.norm(w))
  int4_rel = float(jnp.linalg.norm(quant.quantize_int4(w).dequantize() - w) / jnp.linalg.norm(w))
  assert int4_rel < rel < 0.45, (int4_rel, rel)
  assert q.data.codebook.shape == (E, 2, 256)
  # 8-bit index per 4 weights, a bf16 scale per 128, and a 2 KiB codebook per expert (large for this small matrix).
  assert q.bits_per_weight() == pytest.approx(2 + 16 / 128 + 256 * 4 * 2 * 8 / (K * N))
  assert quant.quantize_vq2(w, codebook="layer", iters=2).data.codebook.shape == (1, 2, 256)
  qs = quant.quantize_vq2(w, sparsity="2:4", iters=5)
  wh = np.asarray(qs.dequantize()).reshape(E, K // 128, 4, 32, N)
  assert np.all(np.sum(wh == 0, axis=2) >= 2)


def test_pallas_registry_runs_vq2_and_falls_back_for_arrays():
  q = quant.quantize_vq2(_w(5), iters=2)
  x = jax.random.normal(jax.random.key(6), (9, K))
  gs = jnp.asarray([4, 5], jnp.int32)
  got = kernels.pallas_grouped_matmul(x, q, gs)
  want = jax.lax.ragged_dot(x, q.dequantize(), gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(kernels.pallas_grouped_matmul(x, _w(5), gs)),
                             np.asarray(jax.lax.ragged_dot(x, _w(5), gs)), rtol=1e-6)


def test_quantized_model_pallas_fused_matches_xla(tiny_model):
  tokens = jnp.asarray([[5, 17, 99, 3, 42]], jnp.int32)
  q = quant.quantize_experts(nnx.clone(tiny_model), "int4")
  want = decode.logits(q, tokens)
  got = decode.logits(quant.set_implementation(nnx.clone(q), "pallas_fused"), tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  base = decode.logits(tiny_model, tokens)
  # Random tiny weights, int4 RTN in both expert matmuls of two layers: logits move by ~10% (measured 0.1).
  assert float(jnp.linalg.norm(want - base) / jnp.linalg.norm(base)) < 0.25


def test_orbax_roundtrip_awq(tiny_model, tiny_config, tmp_path):
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, tiny_config.vocab_size)
  q = quant.quantize_experts(nnx.clone(tiny_model), "int4_awq_sp24", calib=tokens)
  spec = quant.spec_for("int4_awq_sp24")
  quant.save_quantized(q, tiny_config, spec, str(tmp_path / "ck"))
  config, restored, spec2 = quant.load_quantized(str(tmp_path / "ck"))
  assert spec2 == spec and config == tiny_config
  w = quant.expert_weights(restored)["blocks.0.ffn.w_up"]
  assert w.kind == "int4_sp24" and w.data.in_scale is not None
  probe = jnp.asarray([[1, 2, 3]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(decode.logits(restored, probe)), np.asarray(decode.logits(q, probe)))


def test_modes_registered_and_validated():
  from moe_jax import eval as eval_lib  # pylint: disable=g-import-not-at-top
  for name in ("int4", "int4_awq", "vq2", "int4_sp24", "vq2_sp24"):
    assert name in eval_lib.EXPERT_QUANT_MODES
  with pytest.raises(ValueError, match="expert_quant"):
    quant.spec_for("int3")
  with pytest.raises(ValueError, match="sparsity"):
    quant.QuantSpec("int4", sparsity="1:4")


def test_to_mgpu_layout_keeps_the_weight_and_its_grouped_matmul():
  """int4 -> int4_mgpu keeps the dequantized weight exactly and counts int4 as half a byte; the "pallas" grouped
  matmul runs it through the warp-specialized Mosaic GPU kernel (interpret mode here), equal to ragged_dot on the
  bf16-rounded lhs (the kernel's contract) over ragged rows with an empty expert and rows past the groups."""
  w = jax.random.normal(jax.random.key(7), (3, K, 128), jnp.float32)
  q = quant.quantize_int4(w)
  m = quant.QuantizedExperts(kernels.mws.to_mgpu_layout(q.data), kind="int4_mgpu", k=q.k, group_size=q.group_size)
  np.testing.assert_array_equal(np.asarray(m.dequantize()), np.asarray(q.dequantize()))
  assert m.shape == q.shape and abs(m.bits_per_weight() - (4 + 32 / 128)) < 1e-9
  x = jax.random.normal(jax.random.key(8), (11, K))
  gs = jnp.asarray([4, 0, 5], jnp.int32)  # rows 9, 10 belong to no expert: zeros
  got = np.asarray(kernels.pallas_grouped_matmul(x, m, gs))
  want = np.asarray(jax.lax.ragged_dot(x.astype(jnp.bfloat16).astype(jnp.float32), m.dequantize(), gs,
                                       precision=jax.lax.Precision.HIGHEST))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.any(got[9:])


def test_mgpu_kernel_options_reach_the_kernel(monkeypatch):
  """Options stored with int4_mgpu weights (`QuantizedExperts.options`) are passed to the WS kernel on each call, and
  the result with them (R = 32, one compute warpgroup) is the same product."""
  w = jax.random.normal(jax.random.key(9), (3, K, 128), jnp.float32)
  q = quant.quantize_int4(w)
  opts = (("block_r", 32), ("num_compute_wgs", 1))
  m = quant.QuantizedExperts(kernels.mws.to_mgpu_layout(q.data), kind="int4_mgpu", k=q.k, group_size=q.group_size,
                             options=opts)
  seen = []
  real = kernels.mws.int4_grouped_matmul_mgpu_ws

  def spy(*args, **kw):
    seen.append(kw)
    return real(*args, **kw)

  monkeypatch.setattr(kernels.mws, "int4_grouped_matmul_mgpu_ws", spy)
  x = jax.random.normal(jax.random.key(10), (21, K))
  gs = jnp.asarray([17, 0, 3], jnp.int32)  # 17 rows: one 32-row tile
  got = np.asarray(kernels.pallas_grouped_matmul(x, m, gs))
  assert seen and seen[0]["block_r"] == 32 and seen[0]["num_compute_wgs"] == 1
  want = np.asarray(jax.lax.ragged_dot(x.astype(jnp.bfloat16).astype(jnp.float32), m.dequantize(), gs,
                                       precision=jax.lax.Precision.HIGHEST))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.any(got[20:])


def test_to_mgpu_layout_checks_kernel_options(tiny_config):
  """to_mgpu_layout stores valid kernel options with every weight and refuses a bad one with the weight's name and the
  field, before any kernel is traced."""
  config = dataclasses.replace(tiny_config, d_model=128, expert_hidden=128)
  q = quant.quantize_experts(decode.init_model(config, seed=0), "int4")
  r = quant.to_mgpu_layout(nnx.clone(q), block_r=32, table_impl="xla")
  assert {v.options for v in quant.expert_weights(r).values()} == {(("block_r", 32), ("table_impl", "xla"))}
  for kw, msg in ((dict(block_r=12), r"w_gate: block_r=12 must be one of \(8, 16, 24, 32\)"),
                  (dict(num_compute_wgs=3), r"w_gate: num_compute_wgs=3 must be 1 to 4 with N = 128"),
                  (dict(block_k=384), r"w_gate: block_k=384 must be a multiple of 128 dividing the padded K = 128"),
                  (dict(aligned_tiles=1), r"w_gate: aligned_tiles=1 must be True or False"),
                  (dict(table_impl="auto"), r"w_gate: table_impl='auto' must be one of"),
                  (dict(block_m=64), r"w_gate: block_m=64 is not an option of the Mosaic GPU int4 kernel")):
    with pytest.raises(ValueError, match=r"blocks\.\d+\.ffn\." + msg):
      quant.to_mgpu_layout(nnx.clone(q), **kw)


def test_parse_kernel_options():
  """Command-line kernel options: name=value with Python literal values; a malformed item names the flag."""
  got = quant.parse_kernel_options(["block_r=32", " table_impl = 'xla' ", "aligned_tiles=False"], "--mgpu_options")
  assert got == {"block_r": 32, "table_impl": "xla", "aligned_tiles": False}
  assert quant.parse_kernel_options([]) == {}
  for bad in ("block_r", "=32", "block_r=thirty", "block_r=(", "table_impl=xla"):
    with pytest.raises(ValueError, match="--mgpu_options: .* is not name=value"):
      quant.parse_kernel_options([bad], "--mgpu_options")


def test_model_to_mgpu_layout(tiny_config, tiny_model):
  """A whole model re-laid (D = F = 128, so that K groups of 128 and N tiles of 64 apply): every expert weight becomes
  int4_mgpu with the same values (the XLA path's logits are unchanged), and the "pallas" path (the WS kernel, interpret
  mode) gives the same logits up to the lhs's bf16 rounding. The tiny config's weights (group 64, N = 96), AWQ weights
  and bf16 weights are refused with the weight's name."""
  config = dataclasses.replace(tiny_config, d_model=128, expert_hidden=128)
  tokens = jnp.asarray([[5, 17, 99, 3, 42]], jnp.int32)
  q = quant.quantize_experts(decode.init_model(config, seed=0), "int4")
  want = decode.logits(q, tokens)
  r = quant.to_mgpu_layout(nnx.clone(q))
  assert {v.kind for v in quant.expert_weights(r).values()} == {"int4_mgpu"}
  np.testing.assert_array_equal(np.asarray(decode.logits(r, tokens)), np.asarray(want))
  got = decode.logits(quant.set_implementation(r, "pallas"), tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * float(jnp.abs(want).max()))
  with pytest.raises(ValueError, match=r"blocks\.\d+\.ffn\.w_gate: the Mosaic GPU int4 kernel .* \(group 64, N 96"):
    quant.to_mgpu_layout(quant.quantize_experts(nnx.clone(tiny_model), "int4"))
  with pytest.raises(ValueError, match=r"blocks\.\d+\.ffn\.w_gate: to_mgpu_layout takes int4 weights, got Array"):
    quant.to_mgpu_layout(nnx.clone(tiny_model))
  awq = quant.quantize_experts(decode.init_model(config, seed=0), "int4_awq", calib=jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="AWQ scales: True"):
    quant.to_mgpu_layout(awq)
