"""The uniform-codebook compressed store through the fused Mosaic GPU core (interpret mode), merged with the
residual window, against the XLA OS-KVP attention on the same cache (outlier channels zeroed, then included)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.kv_quant import OSKVPMode
from moe_jax.kv_quant import oskvp_attention as attn
from moe_jax.kv_quant import oskvp_cache
from moe_jax.kv_quant import oskvp_uniform_codes as uc
from pallas_kernels import oskvp_decode_core_mgpu as dc
from pallas_kernels import oskvp_decode_core_mma as dm
from pallas_kernels import oskvp_value_layout as vl

B, K, G, H, R = 2, 2, 4, 128, 16


@jax.jit
def _prefill(k, v, lengths):
  """`OSKVPMode(uniform=True).from_prefill` as one program, as the model's jitted prefill runs it (op by op, the fit
  compiles for ~10 s per shape on CPU); the lengths are traced, so one compile per kv head count.

  The refit at the first flush is off (`OSKVPMode.refit_at_first_flush`): no batch here is all shorter than the
  window, so the prefill fits the same U, codebooks and scales either way, and no cache that decodes here has a
  row to refit (prompts of 300 and 150 tokens). On, the idle flag compiled a fit into every decode step: ~10 s of
  compile per `extend` program. The refit itself, uniform caches included, is asserted in test_oskvp_cache.py
  (test_a_prompt_inside_the_window_is_refitted_at_its_first_flush and the tests its `NO_REFIT` note names)."""
  return OSKVPMode(window=R, uniform=True, refit_at_first_flush=False).from_prefill(k, v, lengths, 512, layer=0)


@functools.cache  # the caches are immutable pytrees: the tests that build the same one share it
def _cache(zero_outliers=True, kv_heads=K, lengths=(300, 150), seed=1):
  """A real uniform cache: the prompts' tokens in a 512-token store (capacity = 4 splits · 1 block · 128); the values
  block-major, as `OSKVPMode(uniform=True)` stores them at this capacity."""
  k = jax.random.normal(jax.random.PRNGKey(seed), (B, 300, kv_heads, H)) * jnp.linspace(0.5, 2.0, H)
  v = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, 300, kv_heads, H))
  c = _prefill(k, v, jnp.array(lengths))
  assert c.value_layout == "block_major" and c.codes_v.shape == (B, kv_heads, 512 // 128, H // 4, 128)
  assert c.outl_v.shape == (B, kv_heads, 512 // 128, dc.OUTLIERS, 128)
  if not zero_outliers:
    return c
  return dataclasses.replace(c, outl_k=jnp.zeros_like(c.outl_k), outl_v=jnp.zeros_like(c.outl_v))


def _rows(x):
  return x.reshape(-1, *x.shape[2:])


@jax.jit
def _xla_attention(c, q):
  codes_v, outl_v = c.value_store()
  return attn.oskvp_decode_attention_xla(q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, codes_v, outl_v, c.scale_v, c.cb_v,
                                         c.u_k, c.u_v, c.res_k, c.res_v, c.n_comp, c.n_res)


def _xla(c, q):
  """The XLA OS-KVP attention over the cache's token-major view."""
  return np.asarray(_xla_attention(c, q), np.float32)


def _cache_args(c):
  """The cache's arrays in `uniform_decode_attention`'s order after q."""
  return (c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v, c.cb_v, c.u_k, c.u_v, c.res_k,
          c.res_v, c.n_comp, c.n_res)


def _wired(c, q, glue="pallas", max_splits=None, **kw):
  """`uniform_decode_attention` (the core in interpret mode + the window, merged, rotated back) on the cache."""
  return np.asarray(uc.uniform_decode_attention(q, *_cache_args(c), interpret=True, glue=glue, max_splits=max_splits,
                                                **kw), np.float32)


@jax.jit
def _exact_codes_attention(c, q):
  kh, g = c.codes_k.shape[1], q.shape[1] // c.codes_k.shape[1]
  q_rot = _rows(jnp.einsum("BKGH,BKHJ->BKGJ", q.reshape(B, kh, g, H), c.u_k))
  scale = H**-0.5
  o_c, lse_c = uc.attend_codes(q_rot, _rows(c.codes_k), _rows(c.codes_v), _rows(c.cb_k), _rows(c.cb_v),
                               jnp.repeat(c.n_comp, kh), (_rows(c.outl_k), _rows(c.scale_k), _rows(c.outl_v),
                                                          _rows(c.scale_v)), scale=scale, implementation="xla")
  o_r, lse_r = uc.window_attention(q_rot, _rows(c.res_k), _rows(c.res_v), jnp.repeat(c.n_res, kh), scale=scale)
  o, _ = uc.merge_lse2(o_c, lse_c, o_r, lse_r)
  return jnp.einsum("bgj,bhj->bgh", o, _rows(c.u_v)).reshape(B, kh * g, H)


def _exact_codes(c, q):
  """attend_codes' exact ("xla") path merged with the window and rotated back: the wired function's arithmetic
  without the kernel's quantization."""
  return np.asarray(_exact_codes_attention(c, q))


def _rel(x, want):
  return float(np.linalg.norm(x - want) / np.linalg.norm(want))


def test_codes_plus_window_match_the_xla_attention():
  """Core (interpret) over the codes, exact attention over the window, merged by log-sum-exp, rotated back: within
  3% (relative norm; measured 1.8%) of `oskvp_decode_attention_xla` on the same cache (outliers zeroed on both
  sides). The gap is the kernel's int8 query digits and 127-level p; the exact code path ("xla") agrees to 1e-5
  (measured 2.6e-6)."""
  c = _cache()
  q = jax.random.normal(jax.random.PRNGKey(3), (B, K * G, H))
  want = _xla(c, q)
  assert _rel(_exact_codes(c, q), want) < 1e-5
  assert _rel(_wired(c, q), want) < 0.03


def test_codes_outliers_and_window_match_the_xla_attention():
  """The whole cache (codes + fp8 outlier channels + window) through `uniform_decode_attention`: within 3% (measured
  1.7%) of `oskvp_decode_attention_xla` on a real uniform cache (nothing zeroed); the exact path within 1e-4
  (measured 2.1e-6)."""
  c = _cache(zero_outliers=False)
  q = jax.random.normal(jax.random.PRNGKey(4), (B, K * G, H))
  want = _xla(c, q)
  assert _rel(_exact_codes(c, q), want) < 1e-4
  got = _wired(c, q)
  assert _rel(got, want) < 0.03
  # The jnp glue (attend_codes + window + merge) computes the same thing around the same core.
  np.testing.assert_allclose(_wired(c, q, glue="xla"), got, rtol=1e-4, atol=1e-4 * np.abs(got).max())
  # q U_k inside the prologue (three bf16 dots of hi + lo parts, ~2^-16) instead of the XLA matmul: the same digits
  # but where a rotated query lands within that of a rounding edge (one digit moves the output by ~5e-3 of its
  # largest element): within 3% of the XLA attention as the rest, and within 1e-2 of the XLA rotation's output.
  rot = _wired(c, q, query_rotation="prologue")
  assert _rel(rot, want) < 0.03
  np.testing.assert_allclose(rot, got, rtol=0, atol=1e-2 * np.abs(got).max())
  args = (q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v, c.cb_v, c.u_k, c.u_v, c.res_k,
          c.res_v, c.n_comp, c.n_res)
  program = lambda rotation: str(jax.make_jaxpr(functools.partial(
      uc.uniform_decode_attention, interpret=True, glue="pallas", query_rotation=rotation))(*args))
  assert "oskvp_uniform_rotating_prologue" in program("prologue")  # the option reaches the kernel
  assert "oskvp_uniform_rotating_prologue" not in program("xla")
  with pytest.raises(ValueError, match="query_rotation='kernel'"):
    _wired(c, q, query_rotation="kernel")
  with pytest.raises(ValueError, match="query_rotation='prologue' takes the Pallas glue \\(here 'xla'\\)"):
    _wired(c, q, glue="xla", query_rotation="prologue")
  # One split instead of four (the capacity's 4 blocks): p is quantized against each split's running max, so the
  # two differ only by that quantization (within 1% of each other; each within 3% of the XLA attention).
  one = _wired(c, q, glue="xla", max_splits=1)
  assert _rel(one, want) < 0.03 and _rel(one, got) < 0.01, (_rel(one, want), _rel(one, got))


@pytest.mark.parametrize("kv_heads,g,lengths", [(2, 8, (1, 290)), (4, 1, (130, 17))])
def test_groups_and_ragged_lengths(kv_heads, g, lengths):
  """G = 8 and G = 1; one sequence whose only token is in the window (n_comp = 0: the core's side is empty) or whose
  compressed store ends mid-block: within 3.5% of the XLA attention (the core's int8 query digits and 127-level
  probabilities; measured 0.8-3.0% over five caches' seeds at G = 1), the exact path within 1e-4."""
  c = _cache(zero_outliers=False, kv_heads=kv_heads, lengths=lengths, seed=7)
  assert int(c.n_comp.min()) % 128 or int(c.n_comp.min()) == 0
  q = jax.random.normal(jax.random.PRNGKey(5), (B, kv_heads * g, H))
  want = _xla(c, q)
  assert _rel(_exact_codes(c, q), want) < 1e-4
  got = _wired(c, q)
  for i in range(B):  # per sequence: an empty compressed side must leave the window's attention exactly
    assert _rel(got[i], want[i]) < (1e-5 if int(c.n_comp[i]) == 0 else 0.035), (i, _rel(got[i], want[i]))
  # U_vᵀ inside the epilogue (its three bf16 dots of hi + lo parts, ~2^-16) gives the XLA matmul's output.
  np.testing.assert_allclose(_wired(c, q, output_rotation="epilogue"), got, rtol=0, atol=1e-4 * np.abs(got).max())


def test_the_rotating_epilogue_is_the_epilogue_and_the_xla_rotation():
  """output_rotation="epilogue" (one kernel merges the splits and the window and rotates back by U_vᵀ, writing q's
  dtype): within 1e-4 of the XLA rotation's f32 output (measured ~5e-6: the same merge, the rotation's dots as bf16
  hi + lo parts), and for a bf16 query the XLA path's bf16 output within a bf16 rounding (2^-8 of the largest);
  the option reaches the kernel (one kernel fewer in the program), and what it cannot take is refused by name."""
  c = _cache(zero_outliers=False)
  q = jax.random.normal(jax.random.PRNGKey(4), (B, K * G, H))
  got, want = _wired(c, q, output_rotation="epilogue"), _wired(c, q)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
  q16 = q.astype(jnp.bfloat16)
  got16 = uc.uniform_decode_attention(q16, *_cache_args(c), interpret=True, glue="pallas", output_rotation="epilogue")
  assert got16.dtype == jnp.bfloat16 and got16.shape == q.shape
  want16 = _wired(c, q16)
  np.testing.assert_allclose(np.asarray(got16, np.float32), want16, rtol=0, atol=2**-8 * np.abs(want16).max())
  program = lambda rotation: str(jax.make_jaxpr(functools.partial(
      uc.uniform_decode_attention, interpret=True, glue="pallas", output_rotation=rotation))(q, *_cache_args(c)))
  assert "oskvp_rotating_epilogue" in program("epilogue") and "oskvp_uniform_epilogue" not in program("epilogue")
  assert "oskvp_rotating_epilogue" not in program("xla")
  with pytest.raises(ValueError, match="output_rotation='core'"):
    _wired(c, q, output_rotation="core")
  with pytest.raises(ValueError, match="output_rotation='epilogue' does not apply: the Pallas glue \\(here 'xla'\\)"):
    _wired(c, q, glue="xla", output_rotation="epilogue")


def test_wide_epilogue_programs_give_the_same_output():
  """epilogue_channels=128 (the window scored once per program of 4 runs of 32 channels; 64 is covered by the
  kernel's own tests) gives the default 32-channel programs' output within 1e-5 of the largest element (the same
  arithmetic, regrouped); the option reaches the kernel's grid, and what the epilogue cannot take is refused naming
  the field."""
  c = _cache(zero_outliers=False)
  q = jax.random.normal(jax.random.PRNGKey(6), (B, K * G, H))
  want = _wired(c, q)
  np.testing.assert_allclose(_wired(c, q, epilogue_channels=128), want, rtol=0, atol=1e-5 * np.abs(want).max())
  program = lambda hc: str(jax.make_jaxpr(functools.partial(
      uc.uniform_decode_attention, interpret=True, glue="pallas", epilogue_channels=hc))(q, *_cache_args(c)))
  assert f"grid=({B}, {K}, 1)" in program(128) and f"grid=({B}, {K}, {H // 32})" in program(None)
  with pytest.raises(ValueError, match="epilogue_channels=48 does not apply: channels=48 must be"):
    _wired(c, q, epilogue_channels=48)
  with pytest.raises(ValueError, match="epilogue_channels=64 does not apply: the Pallas glue's epilogue"):
    _wired(c, q, glue="xla", epilogue_channels=64)
  with pytest.raises(ValueError, match="epilogue_channels=64 does not apply: the Pallas glue's epilogue"):
    _wired(c, q, output_rotation="epilogue", epilogue_channels=64)


@jax.jit
def _extend(c, q, k, v):
  return c.extend(q, k, v, None)


def _decode(c, q, k, v):
  """`c.extend` token by token, as decode steps call it (T = 1), through one compiled step per cache layout (op by
  op, each token cost ~1 s of compiles on CPU, the flush's `lax.cond` included): ([B, T, N, H], cache)."""
  outs = []
  for t in range(q.shape[1]):
    o, c = _extend(c, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
    outs.append(o)
  return jnp.concatenate(outs, axis=1), c


def _relaid(c, layout):
  """The cache c with its values stored in `layout` (`oskvp_cache.VALUE_LAYOUTS`)."""
  codes_v, outl_v = c.value_store()
  return dataclasses.replace(c, codes_v=oskvp_cache.stored_values(codes_v, layout),
                             outl_v=oskvp_cache.stored_values(outl_v, layout), value_layout=layout)


@pytest.mark.parametrize("layout", ["block_major", "token_contiguous"])
def test_value_layouts_decode_like_the_token_major_one(layout):
  """The same uniform cache stored token-major and in each Mosaic GPU layout holds identical codes through window
  flushes (a flush writes R value tokens at n_comp: into [B, K, X, S], or across [B, K, S/128, X, 128]'s blocks,
  here 16 tokens inside one block), so `dequantized` is identical, and the XLA path's attention agrees up to float32
  summation order (the layouts' programs reduce in different orders: ~1e-7 seen, 1e-6 stated)."""
  c = _relaid(_cache(zero_outliers=False), layout)
  t = _relaid(c, "token_major")
  steps = 2 * R + 3  # two flushes of the window
  q = jax.random.normal(jax.random.PRNGKey(8), (B, steps, K * G, H))
  kv = jax.random.normal(jax.random.PRNGKey(9), (2, B, steps, K, H))
  o_c, c2 = _decode(c, q, kv[0], kv[1])
  o_t, t2 = _decode(t, q, kv[0], kv[1])
  np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_t), rtol=1e-5, atol=1e-6)
  assert int(c2.n_comp[1]) > int(c.n_comp[1]) and c2.value_layout == layout
  np.testing.assert_array_equal(np.asarray(c2.value_store()[0]), np.asarray(t2.codes_v))
  np.testing.assert_array_equal(np.asarray(c2.value_store()[1]).view(np.uint8), np.asarray(t2.outl_v).view(np.uint8))
  for a, b_ in zip(c2.dequantized(), t2.dequantized()):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.parametrize("layout", ["block_major", "token_contiguous"])
def test_a_flush_across_a_block_boundary(layout):
  """A window flush whose R tokens straddle a 128-token block (n_comp = 120, R = 16: tokens 120..135) writes the
  same codes and outliers in every layout as token-major; a row that does not flush (its write dropped past S)
  leaves the store unchanged."""
  c = _cache(zero_outliers=False)
  c = dataclasses.replace(c, n_comp=jnp.array([120, 120], jnp.int32), n_res=jnp.array([R, R - 1], jnp.int32))
  want = _relaid(c, "token_major")._flush()
  got = _relaid(c, layout)._flush()
  for a, b_ in zip(got.value_store(), want.value_store()):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8))
  before = np.asarray(c.value_store()[0])
  after = np.asarray(got.value_store()[0])
  assert (after[0, :, 120:136] != before[0, :, 120:136]).any()  # row 0 flushed across the boundary
  np.testing.assert_array_equal(after[1], before[1])  # row 1 did not flush
  np.testing.assert_array_equal(np.asarray(got.n_comp), [136, 120])


def test_block_major_values_through_the_wired_path():
  """`uniform_decode_attention` (the core in interpret mode, the Pallas glue) gives bit-equal outputs on the same
  cache with its values block-major or tokens contiguous (the same shared-memory tiles); `value_layout_for` picks
  block-major for a uniform cache whose capacity is a multiple of 128 unless turned off (the mode's cache here is
  block-major: `_cache` asserts it)."""
  c = _cache(zero_outliers=False)
  q = jax.random.normal(jax.random.PRNGKey(12), (B, K * G, H))
  np.testing.assert_array_equal(_wired(c, q), _wired(_relaid(c, "token_contiguous"), q))
  assert oskvp_cache.value_layout_for(True, 512) == "block_major"
  assert oskvp_cache.value_layout_for(True, 576) == "token_contiguous"  # the cores' 64-token blocks
  assert oskvp_cache.value_layout_for(True, 512, block_major=False) == "token_contiguous"
  assert oskvp_cache.value_layout_for(False, 512) == "token_major"
  assert oskvp_cache.VALUE_BLOCK == vl.BLOCK


def test_mosaic_tiling():
  assert uc.mosaic_tiling(65536, 128, 4, 8) == (128, 16)
  assert uc.mosaic_tiling(384, 128, 8, 8) == (128, 1)
  assert uc.mosaic_tiling(192, 128, 4, 8) == (64, 1)
  assert uc.mosaic_tiling(65536, 64, 4, 8) is None  # head dim 64: the core's value side needs H/4 % 32 == 0
  assert uc.mosaic_tiling(65536, 128, 16, 8) is None
  assert uc.mosaic_tiling(100, 128, 4, 8) is None
  # A few rows (batch × kv heads) get more splits, until rows × splits reaches MOSAIC_PROGRAMS (512): batch 1 × 8 kv
  # heads at 64k runs 64 programs per row; batch 8 keeps 16; the splits still divide the blocks.
  assert uc.mosaic_tiling(65536, 128, 4, 8, rows=8) == (128, 64)
  assert uc.mosaic_tiling(65536, 128, 4, 8, rows=64) == (128, 16)
  assert uc.mosaic_tiling(65536, 128, 4, 8, rows=1) == (128, 128)
  assert uc.mosaic_tiling(16384, 128, 4, 8, rows=8) == (128, 64)
  assert uc.mosaic_tiling(2048, 128, 4, 8, rows=8) == (128, 16)  # 16 blocks
  assert uc.mosaic_tiling(65536, 128, 4, 8, rows=8, max_splits=6) == (128, 4)  # a power of two up to max_splits
  with pytest.raises(ValueError, match="max_splits"):
    uc.mosaic_tiling(65536, 128, 4, 8, max_splits=0)
  with pytest.raises(ValueError, match="G = N/K"):
    c = _cache()
    q = jnp.zeros((B, K * 16, H))
    uc.uniform_decode_attention(q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v, c.cb_v,
                                c.u_k, c.u_v, c.res_k, c.res_v, c.n_comp, c.n_res, interpret=True)


def test_float_lengths_are_refused_by_both_glues():
  """Before: the Pallas glue truncated n_comp = 100.5 to 100 (the XLA glue refused it)."""
  c = _cache()
  q = jnp.zeros((B, K * 2, H))
  args = list(_cache_args(c))
  args[-2] = args[-2].astype(jnp.float32)
  for glue in ("pallas", "xla"):
    with pytest.raises(ValueError, match="n_comp must be an integer array"):
      uc.uniform_decode_attention(q, *args, interpret=True, glue=glue)


def test_wired_tiling_follows_the_core():
  """The splits are the core's: the mma core takes the fewest that put MOSAIC_PROGRAMS (512) programs in flight, at
  most 32; the wgmma core (the interpreter's, the XLA glue's, or asked for) starts from 16 and raises to 128;
  max_splits binds both."""
  kw = dict(glue="auto", value_outliers=dc.VALUE_OUTLIERS, mma_key_rows=dm.KEY_ROW_DEFAULT)
  gpu = functools.partial(uc.wired_tiling, 65536, 128, 4, 8, max_splits=None, core="auto", interpret=False, **kw)
  for rows, splits in ((1, 32), (8, 32), (16, 32), (32, 16), (64, 8), (128, 4), (256, 2), (512, 1), (1024, 1)):
    assert gpu(rows, 128) == (128, splits, "pallas", "mma"), rows
  assert gpu(64, 100) == (128, 16, "xla", "wgmma")  # a window the Pallas epilogue does not take: the XLA glue
  interp = functools.partial(uc.wired_tiling, 65536, 128, 4, 8, max_splits=None, core="auto", interpret=True, **kw)
  assert interp(64, 128) == (128, 16, "pallas", "wgmma")
  assert interp(8, 128) == (128, 64, "pallas", "wgmma")
  assert interp(1, 128) == (128, 128, "pallas", "wgmma")
  asked = uc.wired_tiling(65536, 128, 4, 8, 256, 128, max_splits=None, core="wgmma", interpret=False, **kw)
  assert asked == (128, 16, "pallas", "wgmma")
  bound = uc.wired_tiling(65536, 128, 4, 8, 64, 128, max_splits=16, core="auto", interpret=False, **kw)
  assert bound == (128, 16, "pallas", "mma")
  # A program's int32 value sums hold MAX_SPLIT_TOKENS tokens: a longer cache keeps the mma core with more splits.
  long = 4 * dm.MAX_SPLIT_TOKENS // 128 * 128
  _, splits, _, core = uc.wired_tiling(long, 128, 4, 8, 512, 128, max_splits=None, core="auto", interpret=False, **kw)
  assert core == "mma" and long // splits <= dm.MAX_SPLIT_TOKENS and splits == 4, (splits, core)
  with pytest.raises(ValueError, match="core='mma' takes"):
    uc.wired_tiling(65536, 128, 4, 8, 64, 128, max_splits=None, core="mma", interpret=True, **kw)


def test_auto_glue_takes_the_pallas_kernels_where_their_tiles_apply():
  assert uc.resolved_glue("auto", 128, 64, 128) == "pallas"  # 64 splits: batch 1 x 8 kv heads
  assert uc.resolved_glue("auto", 128, 16, 128) == "pallas"
  assert uc.resolved_glue("auto", 96, 64, 128) == "xla"  # a window Triton tiles cannot hold
  assert uc.resolved_glue("auto", 128, 16, 128, 3) == "xla"  # G = 3: the prologue's row groups divide 8
  assert uc.resolved_glue("auto", 128, 16, 128, 8) == "pallas"
  assert uc.resolved_glue("xla", 128, 64, 128) == "xla"
  with pytest.raises(ValueError, match="glue='triton'"):
    uc.resolved_glue("triton", 128, 64, 128)


def test_merge_handles_empty_sides():
  o1, o2 = jnp.ones((2, 3)), 2 * jnp.ones((2, 3))
  lse1, lse2 = jnp.array([0.0, -jnp.inf]), jnp.array([0.0, -jnp.inf])
  o, lse = uc.merge_lse2(o1, lse1, o2, lse2)
  np.testing.assert_allclose(np.asarray(o[0]), 1.5)
  np.testing.assert_allclose(np.asarray(o[1]), 0.0)
  assert float(lse[0]) == 1.0 and float(lse[1]) == -np.inf
  o, _ = uc.merge_lse2(o1, jnp.array([3.0, 3.0]), o2, jnp.array([-jnp.inf, -jnp.inf]))
  np.testing.assert_allclose(np.asarray(o), 1.0)


def test_layer_cache_dispatches_to_the_core(monkeypatch):
  """`implementation="pallas"` on a block-major uniform cache runs `uniform_decode_attention` inside `extend`, off the
  GPU in interpret mode (before, the cache called it with interpret=False and the model's decode step failed on the
  CPU: "Only interpret mode is supported on CPU backend"; this test added interpret=True itself): the same arguments
  in the same order as the XLA path gets, so decode steps agree with the XLA cache's to 3%; a call counter shows the
  core path ran (in each of the two steps of the jitted `extend`)."""
  c = _cache(zero_outliers=False)
  calls = []
  orig = uc.uniform_decode_attention

  def interpreted(*args, **kw):
    calls.append((args[0].shape, kw.get("interpret")))
    return orig(*args, **kw)

  monkeypatch.setattr(uc, "uniform_decode_attention", interpreted)
  q = jax.random.normal(jax.random.PRNGKey(10), (B, 2, K * G, H))
  kv = jax.random.normal(jax.random.PRNGKey(11), (2, B, 2, K, H))
  extend = jax.jit(lambda c, q, k, v: c.extend(q, k, v, None))  # traced here, with the patch in place
  o_p, _ = extend(dataclasses.replace(c, implementation="pallas"), q, kv[0], kv[1])
  o_x, _ = extend(dataclasses.replace(c, implementation="xla"), q, kv[0], kv[1])
  assert calls == [((B, K * G, H), True)] * 2
  assert _rel(np.asarray(o_p), np.asarray(o_x)) < 0.03


def test_layer_cache_takes_the_triton_path_off_hopper(monkeypatch):
  """On a GPU that is not a Hopper (no wgmma) the cache does not call the Mosaic GPU core: it decodes through
  `oskvp_decode_attention` on the token-major view, with the requested implementation."""
  from moe_jax.kv_quant import oskvp_cache  # pylint: disable=g-import-not-at-top
  from pallas_kernels import hopper  # pylint: disable=g-import-not-at-top
  c = _cache(zero_outliers=False)
  monkeypatch.setattr(hopper, "mosaic_gpu_runs", lambda device=None: False)
  monkeypatch.setattr(uc, "uniform_decode_attention", lambda *a, **k: pytest.fail("the Mosaic core was called"))
  impls = []
  orig = oskvp_cache.oskvp_decode_attention

  def recorded(*args, implementation, **kw):
    impls.append(implementation)
    return orig(*args, implementation="xla", **kw)

  monkeypatch.setattr(oskvp_cache, "oskvp_decode_attention", recorded)
  q = jax.random.normal(jax.random.PRNGKey(10), (B, 2, K * G, H))
  kv = jax.random.normal(jax.random.PRNGKey(11), (2, B, 2, K, H))
  extend = jax.jit(lambda c, q, k, v: c.extend(q, k, v, None))  # traced here, with the patches in place
  o_p, _ = extend(dataclasses.replace(c, implementation="pallas"), q, kv[0], kv[1])
  o_x, _ = extend(dataclasses.replace(c, implementation="xla"), q, kv[0], kv[1])
  assert impls[0] == "pallas"
  np.testing.assert_allclose(np.asarray(o_p), np.asarray(o_x), rtol=1e-6, atol=1e-6)


def test_the_warp_level_core_is_refused_where_it_does_not_apply():
  """core="mma" (`oskvp_decode_core_mma`, GPU only; its lowering is tested with the kernel) is refused by name in
  interpret mode and with the XLA glue; an unknown core likewise."""
  c = _cache()
  q = jnp.zeros((B, K * 4, H))
  args = (q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v, c.cb_v, c.u_k, c.u_v, c.res_k,
          c.res_v, c.n_comp, c.n_res)
  with pytest.raises(ValueError, match="core='mma'.*interpret=True"):
    uc.uniform_decode_attention(*args, interpret=True, core="mma")
  with pytest.raises(ValueError, match="core='mma'.*glue.*'xla'"):
    uc.uniform_decode_attention(*args, glue="xla", core="mma")
  with pytest.raises(ValueError, match="core="):
    uc.uniform_decode_attention(*args, core="tcgen05")
  with pytest.raises(ValueError, match="mma_key_rows="):
    uc.uniform_decode_attention(*args, mma_key_rows="token")


def test_auto_core_takes_the_warp_level_core_where_it_applies():
  kw = dict(glue="pallas", block_s=128, head_dim=128, interpret=False, value_outliers=dc.VALUE_OUTLIERS,
            mma_key_rows="tokens")
  assert uc.resolved_core("auto", **kw) == "mma"
  for change in (dict(glue="xla"), dict(block_s=64), dict(head_dim=256), dict(interpret=True),
                 dict(value_outliers="f16"), dict(split_tokens=dm.MAX_SPLIT_TOKENS + 128)):
    assert uc.resolved_core("auto", **{**kw, **change}) == "wgmma", change
  assert uc.resolved_core("wgmma", **kw) == "wgmma"
  with pytest.raises(ValueError, match="value_outliers='f16'"):
    uc.resolved_core("mma", **{**kw, "value_outliers": "f16"})
  with pytest.raises(ValueError, match="blocks of 128 tokens"):
    uc.resolved_core("mma", **{**kw, "block_s": 64})
  with pytest.raises(ValueError, match="tokens per program"):  # its int32 value sums' range (`value_plane`)
    uc.resolved_core("mma", **{**kw, "split_tokens": dm.MAX_SPLIT_TOKENS + 128})
  assert uc.resolved_core("auto", **{**kw, "split_tokens": dm.MAX_SPLIT_TOKENS}) == "mma"

