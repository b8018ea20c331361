"""The uniform-codebook compressed store through the fused Mosaic GPU core (interpret mode), merged with the
residual window, against the XLA OS-KVP attention on the same cache (outlier channels zeroed, then included)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.kv_quant import OSKVPMode
from moe_jax.kv_quant import oskvp_attention as attn
from moe_jax.kv_quant import oskvp_uniform_codes as uc
from pallas_kernels import oskvp_value_sums_mgpu as vs

B, K, G, H, R = 2, 2, 4, 128, 16


def _cache(zero_outliers=True):
  """A real uniform cache: 300 and 150 prompt tokens in a 512-token store (capacity = 2 splits · 2 blocks · 128)."""
  k = jax.random.normal(jax.random.PRNGKey(1), (B, 300, K, H)) * jnp.linspace(0.5, 2.0, H)
  v = jax.random.normal(jax.random.PRNGKey(2), (B, 300, K, H))
  c = OSKVPMode(window=R, uniform=True).from_prefill(k, v, jnp.array([300, 150]), 512, layer=0)
  if not zero_outliers:
    return c
  return dataclasses.replace(c, outl_k=jnp.zeros_like(c.outl_k), outl_v=jnp.zeros_like(c.outl_v))


def _rows(x):
  return x.reshape(B * K, *x.shape[2:])


def _through_codes(c, q, outliers=None):
  """attend_codes ("xla" and "pallas" in interpret mode) merged with exact window attention, rotated back."""
  q_rot = _rows(jnp.einsum("BKGH,BKHJ->BKGJ", q.reshape(B, K, G, H), c.u_k))  # [BK, G, H]
  lengths = jnp.repeat(c.n_comp, K)
  vt = vs.token_contiguous(_rows(c.codes_v))
  scale = H**-0.5
  sr = jnp.einsum("bgh,brh->bgr", q_rot, _rows(c.res_k).astype(jnp.float32)) * (scale * uc.LOG2E)
  sr = jnp.where(jnp.arange(R)[None, None, :] < jnp.repeat(c.n_res, K)[:, None, None], sr, -jnp.inf)
  top = sr.max(axis=-1)
  pr = jnp.exp2(sr - top[..., None])
  o_res = jnp.einsum("bgr,brh->bgh", pr, _rows(c.res_v).astype(jnp.float32)) / pr.sum(-1)[..., None]
  lse_res = top + jnp.log2(pr.sum(-1))
  outs = {}
  for impl in ("xla", "pallas"):
    o_codes, lse_codes = uc.attend_codes(q_rot, _rows(c.codes_k), vt, _rows(c.cb_k), _rows(c.cb_v), lengths,
                                         outliers, scale=scale, implementation=impl, interpret=True, block_s=128,
                                         splits=2)
    o, _ = uc.merge_lse2(o_codes, lse_codes, o_res, lse_res)
    o = jnp.einsum("bgj,bhj->bgh", o, _rows(c.u_v))
    outs[impl] = np.asarray(o.reshape(B, K * G, H))
  return outs


def test_codes_plus_window_match_the_xla_attention():
  """Core (interpret) over the codes, exact attention over the window, merged by log-sum-exp, rotated back: within
  3% (relative norm; measured 1.8%) of `oskvp_decode_attention_xla` on the same cache (outliers zeroed on both
  sides). The gap is the kernel's int8 query digits and 127-level p; the exact code path ("xla") agrees to 1e-5
  (measured 2.6e-6)."""
  c = _cache()
  q = jax.random.normal(jax.random.PRNGKey(3), (B, K * G, H))
  want = attn.oskvp_decode_attention_xla(q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v,
                                         c.cb_v, c.u_k, c.u_v, c.res_k, c.res_v, c.n_comp, c.n_res)
  outs = _through_codes(c, q)
  want = np.asarray(want, np.float32)
  rel = lambda x: float(np.linalg.norm(x - want) / np.linalg.norm(want))
  assert rel(outs["xla"]) < 1e-5, rel(outs["xla"])
  assert rel(outs["pallas"]) < 0.03, rel(outs["pallas"])


def test_codes_outliers_and_window_match_the_xla_attention():
  """The whole compressed store (codes + fp8 outlier channels) through the core, merged with the window: within 3%
  (measured 1.7%) of `oskvp_decode_attention_xla` on a real uniform cache (nothing zeroed); the exact path within
  1e-4 (measured 2.1e-6)."""
  c = _cache(zero_outliers=False)
  q = jax.random.normal(jax.random.PRNGKey(4), (B, K * G, H))
  want = attn.oskvp_decode_attention_xla(q, c.codes_k, c.outl_k, c.scale_k, c.cb_k, c.codes_v, c.outl_v, c.scale_v,
                                         c.cb_v, c.u_k, c.u_v, c.res_k, c.res_v, c.n_comp, c.n_res)
  outs = _through_codes(c, q, outliers=(_rows(c.outl_k), _rows(c.scale_k), jnp.swapaxes(_rows(c.outl_v), 1, 2),
                                       _rows(c.scale_v)))
  want = np.asarray(want, np.float32)
  rel = lambda x: float(np.linalg.norm(x - want) / np.linalg.norm(want))
  assert rel(outs["xla"]) < 1e-4, rel(outs["xla"])
  assert rel(outs["pallas"]) < 0.03, rel(outs["pallas"])


def test_merge_handles_empty_sides():
  o1, o2 = jnp.ones((2, 3)), 2 * jnp.ones((2, 3))
  lse1, lse2 = jnp.array([0.0, -jnp.inf]), jnp.array([0.0, -jnp.inf])
  o, lse = uc.merge_lse2(o1, lse1, o2, lse2)
  np.testing.assert_allclose(np.asarray(o[0]), 1.5)
  np.testing.assert_allclose(np.asarray(o[1]), 0.0)
  assert float(lse[0]) == 1.0 and float(lse[1]) == -np.inf
  o, _ = uc.merge_lse2(o1, jnp.array([3.0, 3.0]), o2, jnp.array([-jnp.inf, -jnp.inf]))
  np.testing.assert_allclose(np.asarray(o), 1.0)
