"""Weight quantizers (int4 RTN / AWQ / 2:4, vq2) and their use in the model: errors, layouts, bytes, I/O."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax import decode
from moe_jax import experts
from moe_jax import quant
from moe_jax.quant import kernels
from pallas_kernels import hopper
from pallas_kernels import int4_gate_up_mgpu as gu
from sharding import rules

E, K, N = 2, 256, 64


@jax.jit
def _w(seed=0):
  return jax.random.normal(jax.random.key(seed), (E, K, N), jnp.float32)


# Jitted helpers (same computations): one program per shape instead of a compile per eager operation.
_ragged_dot = jax.jit(jax.lax.ragged_dot, static_argnames=("precision", "preferred_element_type"))
_gate_up_swiglu_xla = jax.jit(experts.GATE_UP_SWIGLU["xla"])


@jax.jit
def _rel_err(q, w):
  """||W_hat - W|| / ||W||."""
  return jnp.linalg.norm(q.dequantize() - w) / jnp.linalg.norm(w)


@jax.jit
def _ragged_bf16_lhs(x, w, gs):
  """The kernels' contract: ragged_dot of the bf16-rounded lhs with the weight w at HIGHEST precision."""
  return jax.lax.ragged_dot(x.astype(jnp.bfloat16).astype(jnp.float32), w, gs, precision=jax.lax.Precision.HIGHEST)


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


def test_2_4_saliency_ties_fall_back_to_magnitude():
  """Channels no calibration row reached have saliency 0: an expert without calibration rows is pruned by magnitude
  as with no calibration at all (before: four-way ties kept slots 2 and 3 whatever the weights, relative error
  0.69 instead of 0.37, and the zero K padding instead of the weights in the tiny model)."""
  w = _w(5)
  importance = jnp.stack([jnp.ones((K,)), jnp.zeros((K,))])  # expert 1: no calibration row
  np.testing.assert_array_equal(np.asarray(quant.int4.prune_24(w, 128, importance))[1],
                                np.asarray(quant.int4.prune_24(w, 128))[1])
  calib = jax.random.normal(jax.random.key(6), (E, 16, K)).at[1].set(0.0)
  for mode in ("int4_sp24", "int4_awq_sp24", "vq2_sp24"):
    calibrated = quant.quantize_weight(w, quant.spec_for(mode), calib)
    magnitude = quant.quantize_weight(w, quant.spec_for(mode.replace("_awq", "")), None)
    assert float(_rel_err(calibrated, w)) < 0.45, mode
    np.testing.assert_allclose(np.asarray(calibrated.dequantize())[1], np.asarray(magnitude.dequantize())[1],
                               rtol=0, atol=1e-6, err_msg=mode)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_awq_keeps_a_channel_quiet_at_calibration(dtype):
  """A channel zero in every calibration row is scaled as a typical one (a = 1): before, floored at 1e-6, its
  weights quantized to 0 and the kernel's x · (1/a) (1/a = 239) overflowed float16 (NaN everywhere) or, in
  bfloat16, cancelled to an error of 2 in outputs of 30 once the channel was active at inference."""
  w = _w(7)[:1, :128, :16]
  calib = jax.random.normal(jax.random.key(8), (1, 16, 128)).at[:, :, :8].multiply(30.0).at[:, :, 10].set(0.0)
  q = quant.quantize_int4(w, calib_x=calib, awq=True)
  assert 0.1 < float(q.data.in_scale[0, 10]) < 10.0
  x = jax.random.normal(jax.random.key(9), (2, 128)).at[:, 10].set(300.0).astype(dtype)
  gs = jnp.asarray([2], jnp.int32)
  ref = np.asarray(x, np.float64) @ np.asarray(q.dequantize(), np.float64)[0]
  assert np.abs(ref).max() > 100  # the channel's weights survived quantization
  got = np.asarray(experts.GROUPED_MATMULS["pallas"](x, q, gs), np.float64)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, rtol=0, atol=0.01 * np.abs(ref).max())


def test_awq_beats_rtn_on_outlier_channels():
  w = _w(2)
  scale = jnp.ones((K,)).at[:8].set(30.0)  # a few input channels carry large activations
  x = jax.random.normal(jax.random.key(3), (E, 64, K)) * scale
  out_err = jax.jit(lambda q: jnp.linalg.norm(jnp.einsum("ERK,EKN->ERN", x, q.dequantize() - w)))
  err = {}
  for awq in (False, True):
    q = quant.quantize_int4(w, calib_x=x, awq=awq)
    err[awq] = float(out_err(q))
  assert err[True] < 0.8 * err[False], err


def test_vq2_error_bits_and_codebooks():
  w = _w(4)
  q = quant.quantize_vq2(w, iters=10)
  rel = float(_rel_err(q, w))
  int4_rel = float(_rel_err(quant.quantize_int4(w), w))
  assert int4_rel < rel < 0.45, (int4_rel, rel)
  assert q.data.codebook.shape == (E, 2, 256)
  # 8-bit index per 4 weights, a bf16 scale per 128, and a 2 KiB codebook per expert (large for this small matrix).
  assert q.bits_per_weight() == pytest.approx(2 + 16 / 128 + 256 * 4 * 2 * 8 / (K * N))
  assert quant.quantize_vq2(w, codebook="layer", iters=2).data.codebook.shape == (1, 2, 256)
  qs = quant.quantize_vq2(w, sparsity="2:4", iters=5)
  wh = np.asarray(qs.dequantize()).reshape(E, K // 128, 4, 32, N)
  assert np.all(np.sum(wh == 0, axis=2) >= 2)


def test_vq2_awq_lowers_the_output_error_on_uneven_channels():
  """vq2_awq weights the k-means and the scale refit by E[x_k^2]: on inputs whose channels differ in scale by 30x the
  calibration output error ||x (W - W_hat)|| / ||x W|| is lower than plain vq2's by at least 20% (relative), the
  weight error higher; the stored format is the same. It needs calibration inputs and dense weights."""
  @jax.jit
  def inputs():
    ks = jax.random.split(jax.random.key(21), 3)
    w = jax.random.normal(ks[0], (E, K, N), jnp.float32)
    loud = jnp.where(jax.random.uniform(ks[1], (K,)) < 0.1, 30.0, 1.0)  # 10% of the channels 30x louder
    return w, jax.random.normal(ks[2], (E, 64, K)) * loud

  w, x = inputs()
  plain, aware = quant.quantize_vq2(w, iters=10), quant.quantize_vq2(w, iters=10, calib_x=x, awq=True)
  out_err_jit = jax.jit(lambda q: jnp.linalg.norm(jnp.einsum("erk,ekn->ern", x, w - q.dequantize()))
                        / jnp.linalg.norm(jnp.einsum("erk,ekn->ern", x, w)))
  out_err = lambda q: float(out_err_jit(q))
  w_err = lambda q: float(_rel_err(q, w))
  assert aware.kind == plain.kind == "vq2" and aware.nbytes == plain.nbytes
  assert out_err(aware) < 0.8 * out_err(plain), (out_err(aware), out_err(plain))
  assert w_err(aware) > w_err(plain)
  with pytest.raises(ValueError, match="awq=True needs calib_x"):
    quant.quantize_vq2(w, awq=True)
  with pytest.raises(ValueError, match="dense weights only"):
    quant.QuantSpec("vq2", awq=True, sparsity="2:4")


def test_quantizers_name_bad_shapes_and_group_sizes():
  w = jnp.ones((2, 256, 64), jnp.float32)
  x = jnp.ones((2, 8, 256), jnp.float32)
  for fn in (quant.quantize_int4, functools.partial(quant.quantize_vq2, iters=1)):
    with pytest.raises(ValueError, match=r"w must be an expert weight \[E, K, N\]"):
      fn(w[0])
    with pytest.raises(ValueError, match="group_size=100 must be a positive multiple of"):
      fn(w, group_size=100)
    with pytest.raises(ValueError, match="group_size=64 must be a positive multiple of 128 with sparsity='2:4'"):
      fn(w, group_size=64, sparsity="2:4")
    for bad in (x[:, :, :128], x[0], x[:1], jnp.swapaxes(x, 1, 2)):  # wrong K, 2-D, wrong E, [E, K, R]
      with pytest.raises(ValueError, match=r"calib_x must be \[E, R, K\] = \[2, R, 256\]"):
        fn(w, calib_x=bad, awq=True)
  with pytest.raises(ValueError, match="group_size=32 must be a positive multiple of 64"):
    quant.quantize_vq2(w, group_size=32)
  with pytest.raises(ValueError, match="group_size=32 must be >= 64 for fmt='vq2'"):
    quant.QuantSpec("vq2", group_size=32)  # before: 64 used silently, 32 recorded in quant.json
  with pytest.raises(ValueError, match="group_size=64 must be >= 128 for fmt='int4' with 2:4 sparsity"):
    quant.QuantSpec("int4", sparsity="2:4", group_size=64)
  q = quant.quantize_weight(jnp.ones((3, 128, 64)), quant.spec_for("int4"))
  out = kernels.pallas_grouped_matmul(jnp.zeros((0, 128)), q, jnp.zeros((3,), jnp.int32))
  assert out.shape == (0, 64)  # no rows, as ragged_dot allows (before: ZeroDivisionError)
  with pytest.raises(ValueError, match="iters=0 must be a positive int"):  # before: silently no k-means step
    quant.quantize_vq2(w, iters=0)


def test_pallas_registry_runs_vq2_and_falls_back_for_arrays():
  q = quant.quantize_vq2(_w(5), iters=2)
  x = jax.random.normal(jax.random.key(6), (9, K))
  gs = jnp.asarray([4, 5], jnp.int32)
  got = kernels.pallas_grouped_matmul(x, q, gs)
  want = _ragged_dot(x, q.dequantize(), gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(kernels.pallas_grouped_matmul(x, _w(5), gs)),
                             np.asarray(_ragged_dot(x, _w(5), gs)), rtol=1e-6)


def test_kernel_routes_name_an_lhs_of_another_k_and_float_group_sizes():
  """The routes zero-pad lhs to the weight's stored Kp: an lhs of fewer columns than the weight's K ran, its missing
  columns taken as zeros ("xla" refuses it), and float group_sizes were truncated by the int32 cast."""
  q = quant.quantize_weight(_w(5), quant.QuantSpec("int4"))
  gs = jnp.asarray([4, 5], jnp.int32)
  for k in (K - 8, K + 8):
    x = jnp.ones((9, k))
    with pytest.raises(ValueError, match=rf"lhs \(9, {k}\) must be \[M, K = {K}\]"):
      kernels.pallas_grouped_matmul(x, q, gs)
    with pytest.raises(ValueError, match=rf"lhs \(9, {k}\) must be \[M, K = {K}\]"):
      kernels.pallas_fused_swiglu(x, q, q, gs)
  with pytest.raises(ValueError, match="group_sizes must be integers, got dtype float32"):
    kernels.pallas_grouped_matmul(jnp.ones((9, K)), q, jnp.asarray([4.5, 4.5]))


def test_quantized_model_pallas_fused_matches_xla(tiny_model):
  tokens = jnp.asarray([[5, 17, 99, 3, 42]], jnp.int32)
  q = quant.quantize_experts(nnx.clone(tiny_model), "int4")
  want = decode.logits(q, tokens)
  got = decode.logits(quant.set_implementation(nnx.clone(q), "pallas_fused"), tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  base = decode.logits(tiny_model, tokens)
  # Random tiny weights, int4 RTN in both expert matmuls of two layers: logits move by ~10% (measured 0.1).
  assert float(jnp.linalg.norm(want - base) / jnp.linalg.norm(base)) < 0.25


def test_quantizing_twice_is_refused_and_surrogates_read_quantized_experts(tiny_model):
  q = quant.quantize_experts(nnx.clone(tiny_model), "int4")
  with pytest.raises(ValueError, match=r"w_gate of a MoE layer is already quantized \(int4\)"):
    quant.quantize_experts(q, "int4")  # before: AttributeError 'QuantizedExperts' object has no attribute 'astype'
  from moe_jax import surrogates  # pylint: disable=g-import-not-at-top
  built = surrogates.build_surrogates(q, rank=8)  # before: AttributeError (no 'dtype'): --routing=lcvc failed
  layer = q.blocks[0].ffn
  deq = [getattr(layer, n)[...].dequantize() for n in ("w_gate", "w_up", "w_down")]
  ref = surrogates.LowRankExperts(*deq, rank=8)  # the surrogates approximate what the quantized layer computes
  for a, b in zip(jax.tree_util.tree_leaves(nnx.state(built[0])), jax.tree_util.tree_leaves(nnx.state(ref))):
    np.testing.assert_array_equal(a, b)


def test_convert_checks_its_output_and_sparsity_before_any_work(tmp_path, monkeypatch):
  """Before: --out= wrote into the working directory; an existing params/ of the user's was replaced (orbax's
  forced save); a file failed in os.makedirs after the quantization; --sparsity=none on a 2:4 mode was ignored
  and reported as dense. All are refused now before the checkpoint loads."""
  from moe_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from moe_jax.quant import convert  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(checkpoints, "load", lambda *a, **k: pytest.fail("loaded the checkpoint first"))
  (tmp_path / "mine" / "params").mkdir(parents=True)
  (tmp_path / "mine" / "params" / "keep.txt").write_text("keep")
  (tmp_path / "file").write_text("")
  for out, message in (("", "out='' names no directory"), (str(tmp_path / "mine"), "params/ that no save_quantized"),
                       (str(tmp_path / "file"), "is a file")):
    with pytest.raises(ValueError, match=message):
      convert.convert("tiny-trained", "int4", out)
  assert (tmp_path / "mine" / "params" / "keep.txt").read_text() == "keep"
  with pytest.raises(ValueError, match="sparsity='none' with expert_quant='int4_sp24', a 2:4-sparse mode"):
    convert.convert("tiny-trained", "int4_sp24", str(tmp_path / "new"), sparsity="none")


def test_unreadable_quantized_checkpoints_are_refused_before_writing(tiny_model, tiny_config, tmp_path):
  from moe_jax import checkpoints  # pylint: disable=g-import-not-at-top
  q = quant.quantize_experts(nnx.clone(tiny_model), "int4")
  with pytest.raises(ValueError, match=r"w_down is 'int4' but spec=.*rebuilds 'vq2'"):  # before: written, then
    quant.save_quantized(q, tiny_config, quant.spec_for("vq2"), str(tmp_path / "a"))  # orbax's structure mismatch
  with pytest.raises(ValueError, match=r"w_down is 'unquantized' but spec=.*rebuilds 'int4'"):
    quant.save_quantized(tiny_model, tiny_config, quant.spec_for("int4"), str(tmp_path / "b"))
  with pytest.raises(ValueError, match="export writes plain models; save a quantized one with"):
    checkpoints.export(q, tiny_config, str(tmp_path / "c"))  # before: written, then "missing blocks.*.ffn.w_*"
  from moe_jax import locality  # pylint: disable=g-import-not-at-top
  routed = locality.with_lcvc(nnx.clone(q), locality.LCVCConfig(n_nodes=2, penalty=1.0))
  with pytest.raises(ValueError, match=r"extra \[\"\['blocks'\]\[0\]\['ffn'\]\['penalty'\]"):
    quant.save_quantized(routed, tiny_config, quant.spec_for("int4"), str(tmp_path / "d"))  # before: unloadable
  assert not any((tmp_path / d).exists() for d in "abcd")


def test_awq_calibration_tokens_are_checked_against_the_model(tiny_model, tiny_config):
  bad = np.ones((1, 16), np.int32)
  bad[0, 3] = tiny_config.vocab_size
  with pytest.raises(ValueError, match=r"calib: token id 264 at tokens\[0, 3\] is outside the vocabulary"):
    quant.quantize_experts(nnx.clone(tiny_model), "int4_awq", calib=bad)  # before: calibrated on NaN activations
  short = decode.init_model(tiny_config.replace(max_seq_len=64), seed=0)
  with pytest.raises(ValueError, match=r"calib \(the default, stdlib bytes: pass calib= tokens of this model\)"):
    quant.quantize_experts(short, "int4_awq")  # the default windows are longer than this model's max_seq_len


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
  for name in ("int4", "int4_awq", "vq2", "vq2_awq", "int4_sp24", "vq2_sp24"):
    assert name in eval_lib.EXPERT_QUANT_MODES
  with pytest.raises(ValueError, match="expert_quant"):
    quant.spec_for("int3")
  with pytest.raises(ValueError, match="sparsity"):
    quant.QuantSpec("int4", sparsity="1:4")
  with pytest.raises(ValueError, match="kmeans_iters=0"):
    quant.QuantSpec("vq2", kmeans_iters=0)


def test_to_mgpu_layout_keeps_the_weight_and_its_grouped_matmul(interpreted):
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
  got = np.asarray(interpreted(lambda: kernels.pallas_grouped_matmul(x, m, gs)))
  want = np.asarray(_ragged_bf16_lhs(x, m.dequantize(), gs))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.any(got[9:])


def test_mgpu_kernel_options_reach_the_kernel(monkeypatch, interpreted):
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
  got = np.asarray(interpreted(lambda: kernels.pallas_grouped_matmul(x, m, gs)))
  assert seen and seen[0]["block_r"] == 32 and seen[0]["num_compute_wgs"] == 1
  want = np.asarray(_ragged_bf16_lhs(x, m.dequantize(), gs))
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


def test_model_to_mgpu_layout(tiny_config, tiny_model, interpreted):
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
  got = interpreted(lambda: decode.logits(quant.set_implementation(r, "pallas"), tokens))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * float(jnp.abs(want).max()))
  with pytest.raises(ValueError, match=r"blocks\.\d+\.ffn\.w_gate: the Mosaic GPU int4 kernel .* \(group 64, N 96"):
    quant.to_mgpu_layout(quant.quantize_experts(nnx.clone(tiny_model), "int4"))
  with pytest.raises(ValueError, match=r"blocks\.\d+\.ffn\.w_gate: to_mgpu_layout takes int4 or vq2 weights, got Array"):
    quant.to_mgpu_layout(nnx.clone(tiny_model))
  awq = quant.quantize_experts(decode.init_model(config, seed=0), "int4_awq", calib=jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="AWQ scales: True"):
    quant.to_mgpu_layout(awq)


def test_model_to_mgpu_layout_vq2(tiny_config, tiny_model, tmp_path, monkeypatch):
  """A vq2 model (D = F = 128) re-laid: every expert weight becomes vq2_mgpu with the same values (the XLA path's
  logits equal the vq2 model's exactly) and the stored options; the "pallas" path sends each layer's three weights
  to the Mosaic GPU vq2 kernel with those options and the lhs padded and rounded to bf16 (the kernel is replaced
  here by its XLA reference: its own values are `test_vq2_grouped_matmul_mgpu_ws.py`'s, in interpret mode, whose
  warpgroup threads a whole model's calls would starve on 2 cores), and the logits match within the lhs's bf16
  rounding. Refused, naming the weight and the field: the tiny config's group 64, fuse_gate_up, an int4-only
  option; save_quantized refuses the layout."""
  config = dataclasses.replace(tiny_config, d_model=128, expert_hidden=128)
  tokens = jnp.asarray([[5, 17, 99, 3, 42]], jnp.int32)
  fast = quant.QuantSpec("vq2", kmeans_iters=2)  # the layout, not the codebooks' fit, is what is checked here
  q = quant.quantize_experts(decode.init_model(config, seed=0), fast)
  want = decode.logits(q, tokens)
  r = quant.to_mgpu_layout(nnx.clone(q), num_compute_wgs=1)
  weights = quant.expert_weights(r)
  assert {v.kind for v in weights.values()} == {"vq2_mgpu"}
  assert {v.options for v in weights.values()} == {(("num_compute_wgs", 1),)}
  for name, v in quant.expert_weights(q).items():
    np.testing.assert_array_equal(np.asarray(weights[name].dequantize()), np.asarray(v.dequantize()))
  np.testing.assert_array_equal(np.asarray(decode.logits(r, tokens)), np.asarray(want))
  calls = []

  def reference(x, w, gs, **kw):
    calls.append((x.dtype, x.shape[1], kw))
    return kernels.vmws.vq2_grouped_matmul_mgpu_ws_reference(x, w, gs)

  monkeypatch.setattr(kernels.vmws, "vq2_grouped_matmul_mgpu_ws", reference)
  got = decode.logits(quant.set_implementation(r, "pallas"), tokens)
  assert len(calls) == 3 * config.n_layers
  assert all(dt == jnp.bfloat16 and k == 128 and kw == {"interpret": True, "num_compute_wgs": 1}
             for dt, k, kw in calls)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * float(jnp.abs(want).max()))
  with pytest.raises(ValueError, match=r"blocks\.\d+\.ffn\.w_gate: the Mosaic GPU vq2 kernel .* \(group 64, N 96"):
    quant.to_mgpu_layout(quant.quantize_experts(nnx.clone(tiny_model), fast))
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: fuse_gate_up takes int4 weights, not vq2"):
    quant.to_mgpu_layout(nnx.clone(q), fuse_gate_up=True)
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: aligned_tiles=False is not an option of the Mosaic GPU "
                                       r"vq2 kernel"):
    quant.to_mgpu_layout(nnx.clone(q), aligned_tiles=False)
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: save_quantized .* 'vq2_mgpu'"):
    quant.save_quantized(r, config, quant.spec_for("vq2"), str(tmp_path / "ck"))


@pytest.fixture(scope="module")
def int4_model_128(tiny_config):
  """The tiny model with D = F = 128 (K groups of 128, N tiles of 64) and int4 experts."""
  config = dataclasses.replace(tiny_config, d_model=128, expert_hidden=128)
  return quant.quantize_experts(decode.init_model(config, seed=0), "int4")


def test_fuse_gate_up_layout_values_and_sharding(int4_model_128):
  """to_mgpu_layout(fuse_gate_up=True) stores each layer's gate and up once: w_gate of kind int4_mgpu_gate_up
  [E, D, 2F] at 4 + 32/128 bits per weight and the bytes of the two int4_mgpu weights, w_up `FusedIntoGate` (no
  arrays, 0 bytes). Its de-interleaved weights are the unfused ones and the XLA path's logits the unfused int4_mgpu
  model's, both exactly (tolerance 0: the same dequantized values through the same two ragged_dots). Its arrays
  shard as any quantized expert weight's, experts axis first."""
  tokens = jnp.asarray([[5, 17, 99, 3, 42]], jnp.int32)
  r = quant.to_mgpu_layout(nnx.clone(int4_model_128))
  f = quant.to_mgpu_layout(nnx.clone(int4_model_128), fuse_gate_up=True, block_r=16)
  wr, wf = quant.expert_weights(r), quant.expert_weights(f)
  for i in (0, 1):
    gate, up, both, marker = (wr[f"blocks.{i}.ffn.w_gate"], wr[f"blocks.{i}.ffn.w_up"], wf[f"blocks.{i}.ffn.w_gate"],
                              wf[f"blocks.{i}.ffn.w_up"])
    e, d, ff = up.shape
    assert both.kind == "int4_mgpu_gate_up" and both.shape == (e, d, 2 * ff) and both.options == (("block_r", 16),)
    assert both.nbytes == gate.nbytes + up.nbytes and abs(both.bits_per_weight() - (4 + 32 / 128)) < 1e-9
    assert isinstance(marker, experts.FusedIntoGate) and marker.shape == (e, d, ff) and marker.nbytes == 0
    assert not jax.tree.leaves(marker)
    g, u = both.dequantize_gate_up()
    np.testing.assert_array_equal(np.asarray(g), np.asarray(gate.dequantize()))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(up.dequantize()))
    assert wf[f"blocks.{i}.ffn.w_down"].kind == "int4_mgpu"
  assert quant.expert_bytes(f) == quant.expert_bytes(r)
  np.testing.assert_array_equal(np.asarray(decode.logits(f, tokens)), np.asarray(decode.logits(r, tokens)))
  specs = jax.tree_util.tree_leaves_with_path(rules.tree_specs(nnx.state(f), "ep"), is_leaf=lambda x: isinstance(x, P))
  ffn = {jax.tree_util.keystr(k): v for k, v in specs
         if any(f"['ffn']['{n}']" in jax.tree_util.keystr(k) for n in ("w_gate", "w_up", "w_down"))}
  assert sorted(k for k in ffn if k.startswith("['blocks'][0]['ffn']['w_gate']")) == [
      f"['blocks'][0]['ffn']['w_gate'].value.data.{n}" for n in ("q", "scale", "zero")]
  assert not any("w_up" in k for k in ffn)
  assert all(v == P(rules.RULES["ep"]["experts"], None, None) for v in ffn.values())


def test_fused_gate_up_runs_one_swiglu_call_per_layer(int4_model_128, monkeypatch):
  """"pallas" and "pallas_fused" send a fused gate/up weight to one swiglu=True call of the WS kernel with its stored
  options (w_down: one plain call); the kernel is stubbed here (its values: the next test). Where Mosaic GPU does not
  run, the route refuses as int4_mgpu does; an implementation without a gate/up route is refused by name."""
  f = quant.to_mgpu_layout(nnx.clone(int4_model_128), fuse_gate_up=True, block_r=16)
  moe = f.blocks[0].ffn
  calls = []

  def stub(x, w, gs, **kw):
    calls.append(kw)
    return jnp.zeros((x.shape[0], w.scale.shape[-1] // (2 if kw.get("swiglu") else 1)), jnp.float32)

  monkeypatch.setattr(kernels.mws, "int4_grouped_matmul_mgpu_ws", stub)
  x, gs = jnp.ones((6, 128), jnp.float32), jnp.asarray([2, 0, 4, 0, 0, 0, 0, 0], jnp.int32)
  for impl in ("pallas", "pallas_fused"):
    calls.clear()
    moe.implementation = impl
    assert moe.expert_fn(x, gs).shape == (6, 128)
    assert [c.get("swiglu", False) for c in calls] == [True, False] and all(c["block_r"] == 16 for c in calls)
  monkeypatch.setattr(hopper, "mosaic_gpu_runs", lambda device=None: False)
  with pytest.raises(ValueError, match="'int4_mgpu_gate_up'.*Hopper"):
    moe.expert_fn(x, gs)
  moe.implementation = "no_such_kernel"
  with pytest.raises(ValueError, match="implementation='no_such_kernel' has no route for gate and up fused"):
    moe.expert_fn(x, gs)


def test_fused_gate_up_kernel_route_interpret(interpreted):
  """The "pallas" gate/up route (`kernels.pallas_gate_up_swiglu`, the WS kernel's swiglu=True in interpret mode, two
  compute warpgroups) equals the XLA route on the bf16-rounded lhs (the kernel's contract) within rtol 1e-5 and 1e-5
  of the largest output, over ragged rows with an empty expert and rows past the groups (zeros)."""
  wg, wu = (kernels.mws.to_mgpu_layout(quant.quantize_int4(jax.random.normal(jax.random.key(s), (3, K, 64))).data)
            for s in (11, 12))
  w = quant.QuantizedExperts(gu.interleave_gate_up(wg, wu), kind="int4_mgpu_gate_up", k=K, group_size=128,
                             options=(("num_compute_wgs", 2),))
  x = jax.random.normal(jax.random.key(13), (11, K))
  gs = jnp.asarray([4, 0, 5], jnp.int32)  # rows 9, 10 belong to no expert
  got = np.asarray(interpreted(lambda: kernels.pallas_gate_up_swiglu(x, w, gs)))
  want = np.asarray(_gate_up_swiglu_xla(x.astype(jnp.bfloat16).astype(jnp.float32), w, gs))
  assert got.shape == (11, 64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.any(got[9:])


def test_fuse_gate_up_refusals_and_checkpoints(tiny_config, int4_model_128, tmp_path):
  """fuse_gate_up takes F a multiple of 32 (96 fuses, 80 is refused), gate and up of one shape, and kernel options
  that fit the fused weight's N = 2F; each refusal names the weight and the field. w_up's marker cannot be
  dequantized, and save_quantized refuses the Mosaic layouts (load_quantized rebuilds int4), naming the weight."""
  def int4_model(f):
    config = dataclasses.replace(tiny_config, d_model=128, expert_hidden=f)
    return quant.quantize_experts(decode.init_model(config, seed=0), "int4")

  q96 = int4_model(96)
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: .* N a multiple of 64 \(group 128, N 96"):
    quant.to_mgpu_layout(nnx.clone(q96))
  both = quant.expert_weights(quant.to_mgpu_layout(nnx.clone(q96), fuse_gate_up=True))["blocks.0.ffn.w_gate"]
  np.testing.assert_array_equal(np.asarray(both.dequantize_gate_up()[1]),
                                np.asarray(quant.expert_weights(q96)["blocks.0.ffn.w_up"].dequantize()))
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: .* N a multiple of 32 \(group 128, N 80"):
    quant.to_mgpu_layout(int4_model(80), fuse_gate_up=True)
  odd = nnx.clone(int4_model_128)
  odd.blocks[1].ffn.w_up.set_value(quant.quantize_int4(jax.random.normal(jax.random.key(3), (8, 128, 192))))
  with pytest.raises(ValueError, match=r"blocks\.1\.ffn\.w_up: fuse_gate_up needs gate and up of one shape"):
    quant.to_mgpu_layout(odd, fuse_gate_up=True)
  # num_compute_wgs=3 needs N >= 192: the fused gate/up's 2F = 256 has it, w_down's N = 128 does not.
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_down: num_compute_wgs=3 must be 1 to 4 with N = 128"):
    quant.to_mgpu_layout(nnx.clone(int4_model_128), fuse_gate_up=True, num_compute_wgs=3)
  f = quant.to_mgpu_layout(nnx.clone(int4_model_128), fuse_gate_up=True)
  with pytest.raises(ValueError, match="w_up is fused into w_gate"):
    quant.expert_weights(f)["blocks.0.ffn.w_up"].dequantize()
  spec = quant.spec_for("int4")
  for model, kind in ((f, "int4_mgpu_gate_up"), (quant.to_mgpu_layout(nnx.clone(int4_model_128)), "int4_mgpu")):
    with pytest.raises(ValueError, match=rf"blocks\.0\.ffn\.w_gate: save_quantized .* '{kind}'"):
      quant.save_quantized(model, tiny_config, spec, str(tmp_path / "ck"))


def test_unknown_implementation_and_missing_directory_are_named(tiny_model, tmp_path):
  with pytest.raises(ValueError, match="implementation='cuda' is not a grouped matmul; choose one of"):
    quant.set_implementation(tiny_model, "cuda")
  from moe_jax.quant.experts import moe_layers  # pylint: disable=g-import-not-at-top
  assert all(m is None or m.implementation == "xla" for m in moe_layers(tiny_model))  # nothing switched
  with pytest.raises(ValueError, match="is not a directory written by save_quantized"):
    quant.load_quantized(str(tmp_path))


def test_kernel_route_refuses_n_the_triton_kernels_cannot_tile(tiny_config):
  """Expert hidden 40: the Triton kernels tile N by multiples of 16. set_implementation and quantize_experts name the
  weight before anything runs (before: accepted, then the first forward failed inside the kernel call)."""
  model = decode.init_model(dataclasses.replace(tiny_config, expert_hidden=40))
  quant.quantize_experts(model, "int4")
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: implementation='pallas' runs int4 .* got N=40"):
    quant.set_implementation(model, "pallas")
  from moe_jax.quant.experts import moe_layers  # pylint: disable=g-import-not-at-top
  assert all(m is None or m.implementation == "xla" for m in moe_layers(model))  # nothing switched
  fresh = decode.init_model(dataclasses.replace(tiny_config, expert_hidden=40))
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate: implementation='pallas_fused' runs vq2 .* N=40"):
    quant.quantize_experts(fresh, "vq2", implementation="pallas_fused")
  assert all(isinstance(w, jax.Array) for w in quant.expert_weights(fresh).values())  # refused before quantizing
  quant.set_implementation(model, "xla")  # the XLA route takes any N
  assert np.isfinite(np.asarray(decode.logits(model, jnp.ones((1, 4), jnp.int32)))).all()


@pytest.mark.parametrize("mode", ["int4", "vq2", "int4_sp24", "vq2_sp24"])
def test_quantizers_are_scale_invariant_over_float32s_range(mode):
  """The same weight times 1e-30 ... 1e30 keeps its relative error within 1% of the unit scale's, and a zero weight
  comes back zero (before: int4's scale floor 1e-8 sent weights under ~1e-9 to zero, and vq2's RMS, w² in float32,
  overflowed above ~1e19 and vanished beside its 1e-12 epsilon under ~1e-12: relative error 1.0)."""
  spec = quant.spec_for(mode)
  w = _w(3)
  calib = jax.random.normal(jax.random.key(4), (E, 8, K), jnp.float32) if spec.needs_calibration else None
  def rel(scale):
    q = quant.quantize_weight(w * scale, spec, calib)
    d = np.asarray(q.dequantize(), np.float64) / scale  # back to unit scale before any norm (1e30² overflows)
    return np.linalg.norm(d - np.asarray(w, np.float64)) / np.linalg.norm(np.asarray(w, np.float64))
  unit = rel(1.0)
  assert 0.0 < unit < 0.5
  # Near the top: vq2's refit sums (G products of ~RMS) overflowed from |w| ~1e37 and int4's hi − lo from ~2e38
  # (inf / NaN weights). vq2 stops at 1e37: past ~8e37, 1 / max|w| (its RMS normalisation) is subnormal, flushed.
  top = 1e37 if mode.startswith("vq2") else 5e37
  for scale in (1e-30, 1e-12, 1e-9, 1e19, 1e30, top):
    assert abs(rel(scale) - unit) <= 0.01 * unit, (scale, rel(scale), unit)
  zero = quant.quantize_weight(jnp.zeros_like(w), spec, calib)
  assert np.array_equal(np.asarray(zero.dequantize()), np.zeros(w.shape, np.float32))


def test_gradients_through_the_pallas_routes_are_the_xla_routes():
  """Before: an AssertionError inside jax's Pallas JVP rule (so no fine-tuning of the dense weights of a model whose
  quantized experts ran through "pallas"). Now the kernels' backward is their XLA reference's."""
  from moe_jax.quant import kernels  # pylint: disable=g-import-not-at-top
  rs = np.random.RandomState(0)
  e, k, n, m = 2, 128, 16, 8
  wg, wu = (quant.quantize_int4(jnp.asarray(rs.randn(e, k, n) * 0.1, jnp.float32), group_size=128) for _ in "gu")
  x = jnp.asarray(rs.randn(m, k), jnp.float32)
  gs = jnp.array([5, 3], jnp.int32)
  ct = jnp.asarray(rs.randn(m, n), jnp.float32)
  loss = lambda f: lambda x: jnp.sum(f(x) * ct)  # noqa: E731
  for f_kernel, f_xla in (
      (lambda x: experts.grouped_matmul(x, wg, gs, implementation="pallas"),
       lambda x: experts.grouped_matmul(x, wg, gs, implementation="xla")),
      (lambda x: kernels.fused_swiglu_kernel(x, wg, wu, gs), lambda x: kernels._swiglu_reference(x, wg, wu, gs))):  # pylint: disable=protected-access
    g_kernel, g_xla = jax.grad(loss(f_kernel))(x), jax.grad(loss(f_xla))(x)
    np.testing.assert_allclose(g_kernel, g_xla, rtol=1e-5, atol=1e-6)
    assert float(jnp.linalg.norm(g_xla)) > 1.0


def test_the_report_cli_checks_its_windows_and_output_before_measuring(tmp_path):
  """--n_windows=0 and an --out whose folder cannot be made were refused only after the model loaded and the modes
  were quantized (and measured, for --out)."""
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
  (tmp_path / "file").write_text("")
  for args, message in ((["--n_windows=0"], "--n_windows=0 must be >= 1"),
                        ([f"--out={tmp_path}/file/sub/qr"], "its folder cannot be created")):
    r = subprocess.run([sys.executable, "-m", "moe_jax.quant.report", "--modes=int4", *args], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
