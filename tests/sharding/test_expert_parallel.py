"""Expert parallelism on 8 simulated CPU devices: sharded == unsharded, and a decode step with no cross-node traffic."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moe_jax import decode, dispatch, experts, locality
from sharding import expert_parallel as ep
from sharding import hlo_collectives as hc
from sharding import meshes, rules, runner

pytestmark = pytest.mark.needs_8_devices
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, matmul precision "highest"


@pytest.fixture(scope="module")
def model(tiny_config):
  """One block of the tiny model (every MoE code path, half the compile time)."""
  return decode.init_model(tiny_config.replace(n_layers=1, max_seq_len=32), seed=0)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(11), (8, 12), 0, 256)


@pytest.mark.parametrize("layout", ["1x8", "2x4", "4x2", "8x1"])
def test_sharded_model_equals_unsharded(model, tokens, layout):
  """λ = 0, surrogates off: the expert-parallel model's logits equal the single-device model's."""
  n, _ = meshes.parse_layout(layout)
  lcvc0 = locality.with_lcvc(model, locality.LCVCConfig(n_nodes=n, penalty=0.0))
  sm = runner.shard(lcvc0, meshes.make_mesh(layout=layout))
  np.testing.assert_allclose(sm.logits(tokens), decode.logits(model, tokens), **TOL)


def test_tensor_parallel_layout_equals_unsharded(model, tokens):
  sm = runner.shard(model, meshes.make_mesh(layout="4x2"), layout="ep_tp")  # kv_heads=2 over local=2
  np.testing.assert_allclose(sm.logits(tokens), decode.logits(model, tokens), **TOL)


def test_surrogate_decode_has_no_cross_node_collective(model, tokens):
  """LCVC + surrogates: the compiled decode step's collectives stay inside nodes, and the step equals the
  single-device LCVC model (exact prefill, surrogate decode). (The exact dispatch's all-to-all does cross nodes:
  `test_dispatch_transports_agree_with_local_dispatch`.)"""
  mesh = meshes.make_mesh(layout="2x4")
  model = locality.make_lcvc(model, locality.LCVCConfig(n_nodes=2, penalty=1.0, threshold=0.3,
                                                              surrogates=True), rank=8)
  lengths = jnp.array([12, 5, 9, 12, 1, 7, 12, 3], jnp.int32)
  nxt = jax.random.randint(jax.random.key(12), (8,), 0, 256)
  ref_logits, ref_cache = decode.prefill(locality.set_surrogates(model, False), tokens, lengths, kv_cache="fp32",
                                         cache_len=16)
  ref_step, _ = decode.decode_step(locality.set_surrogates(model, True), ref_cache, nxt)

  sm = runner.shard(model, mesh, surrogate_decode=True)
  logits, cache = sm.prefill(tokens, lengths, kv_cache="fp32", cache_len=16)
  step, cache = sm.decode_step(cache, nxt)
  np.testing.assert_allclose(logits, ref_logits, **TOL)
  np.testing.assert_allclose(step, ref_step, **TOL)
  np.testing.assert_array_equal(cache.lengths, lengths + 1)

  node_of = meshes.device_nodes(mesh)
  local = hc.summarize(sm.decode_hlo(cache, nxt), node_of)
  assert local["n_collectives"] > 0 and local["ops"] == ["all-to-all"]  # the within-node dispatch is there
  assert local["n_cross_node"] == 0 and local["cross_node_bytes"] == 0


def test_one_sharded_model_decodes_caches_of_two_modes(model, tokens):
  """The decode step is cached per cache structure (before: the second mode hit the first one's pytree specs)."""
  sm = runner.shard(model, meshes.make_mesh(layout="2x4"))
  lengths = jnp.array([12, 5, 9, 12, 1, 7, 12, 3], jnp.int32)
  nxt = np.asarray(jax.random.randint(jax.random.key(13), (8,), 0, 256), np.int32)
  for mode, tol in (("fp32", TOL), ("int8", dict(rtol=1e-5, atol=1e-5))):
    _, ref_cache = decode.prefill(model, tokens, lengths, kv_cache=mode, cache_len=16)
    ref_step, _ = decode.decode_step(model, ref_cache, nxt)
    _, cache = sm.prefill(tokens, lengths, kv_cache=mode, cache_len=16)
    step, _ = sm.decode_step(cache, nxt)
    np.testing.assert_allclose(step, ref_step, **tol, err_msg=mode)


def test_sharded_entry_points_name_bad_input_and_impossible_layouts(model, tokens, tiny_config):
  mesh = meshes.make_mesh(layout="2x4")
  sm = runner.shard(model, mesh)
  lengths = np.full((8,), 12, np.int32)
  bad = np.asarray(tokens).copy()
  bad[0, 3] = model.config.vocab_size
  with pytest.raises(ValueError, match=r"token id 264 at tokens\[0, 3\] is outside the vocabulary"):
    sm.prefill(bad, lengths, cache_len=16)  # before: NaN logits for row 0
  with pytest.raises(ValueError, match=r"token id 264 at tokens\[0, 3\]"):
    sm.logits(bad)
  with pytest.raises(ValueError, match=r"lengths=\[13.*exceed the token array's length 12"):
    sm.prefill(tokens, lengths + 1, cache_len=16)  # before: accepted
  _, cache = sm.prefill(tokens, lengths, cache_len=16)
  with pytest.raises(ValueError, match=r"tokens must be an integer array of shape \(8,\).*int32 \(16,\)"):
    sm.decode_step(cache, np.zeros((16,), np.int32))  # before: logits [16, V] and a cache with lengths + 1
  with pytest.raises(ValueError, match=r"the batch \(6 sequences\) must be divisible by the 8 devices"):
    sm.logits(np.asarray(tokens)[:6])  # before: IndivisibleError from device_put
  six = decode.init_model(tiny_config.replace(n_layers=1, max_seq_len=32, n_experts=6))
  with pytest.raises(ValueError, match=r"splits axis 'experts' \(size 6\) of blocks/0/ffn/w_\w+ over mesh axes"):
    runner.shard(six, mesh)
  with pytest.raises(ValueError, match=r"layout='ep_tp' splits axis '(kv_)?heads' \(size \d\) of blocks/0/attn"):
    runner.shard(model, mesh, layout="ep_tp")  # 2 kv heads over local = 4
  with pytest.raises(ValueError, match="surrogate_decode=True needs an LCVC model"):
    runner.shard(model, mesh, surrogate_decode=True)  # before: remote experts silently dropped at decode
  lcvc = locality.with_lcvc(model, locality.LCVCConfig(n_nodes=2, penalty=1.0))
  with pytest.raises(ValueError, match=r"LCVC n_nodes=2 differs from the mesh's node axis \(4\)"):
    runner.shard(lcvc, meshes.make_mesh(layout="4x2"))  # before: tokens and experts placed on different nodes
  # Another model's cache (a layer more): the unsharded step refuses it, the sharded one ran the blocks it had.
  two_layers = decode.init_model(tiny_config.replace(n_layers=2, max_seq_len=32))
  _, other = decode.prefill(two_layers, tokens, lengths, kv_cache="bf16", cache_len=16)
  with pytest.raises(ValueError, match="cache has 2 layers but the model has 1"):
    sm.decode_step(other, np.zeros((8,), np.int32))
  # Options a layout ignored or that failed deep in XLA.
  with pytest.raises(ValueError, match=r"transport='ragged_emulated' / capacity=None set the 'ep' layout's"):
    runner.shard(model, meshes.make_mesh(layout="4x2"), layout="ep_tp", transport="ragged_emulated")
  with pytest.raises(ValueError, match="capacity=2.5 must be an int >= 1 or None"):
    runner.shard(model, mesh, capacity=2.5)
  with pytest.raises(ValueError, match="transport='ragged' needs a GPU"):
    runner.shard(model, mesh, transport="ragged")
  scope_all = locality.make_lcvc(model, locality.LCVCConfig(n_nodes=2, surrogates=True, surrogate_scope="all"),
                                 rank=2)
  with pytest.raises(ValueError, match="surrogate_decode=True with surrogate_scope='all'"):
    runner.shard(scope_all, mesh, surrogate_decode=True)  # before: its prefill ran exact, silently


def _dispatch_body(x, w, ids, w_gate, w_up, w_down, *, dispatcher, n_experts):
  fn = functools.partial(experts.swiglu_experts, w_gate=w_gate, w_up=w_up, w_down=w_down)
  return dispatcher(x, w, ids, lambda xs, gs: fn(xs, gs), n_experts)


def _run_dispatch(dispatcher, mesh, x, w, ids, weights, *, hlo=False):
  both = ("node", "local")
  body = functools.partial(_dispatch_body, dispatcher=dispatcher, n_experts=weights[0].shape[0])
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(both),) * 6, out_specs=P(both), check_vma=False))
  # Host copies: split over the 8 devices on the host, where a device-0 array is resharded by a small program
  # compiled per input shape (five of them).
  args = tuple(np.asarray(a) for a in (x, w, ids, *weights))
  if hlo:
    compiled = f.lower(*args).compile()
    return compiled(*args), compiled.as_text()
  return f(*args)


@functools.partial(jax.jit, static_argnames=("e", "d", "f", "t", "k"))
def _dispatch_inputs(key, *, e, d, f, t, k):
  """x [T, D], weights w [T, X], distinct expert ids int32 [T, X] per token and the experts' (w_gate, w_up, w_down),
  drawn in one program (op by op they were ~15 small compiles)."""
  keys = jax.random.split(key, 6)
  x = jax.random.normal(keys[0], (t, d))
  ids = jnp.argsort(jax.random.uniform(keys[1], (t, e)), axis=1)[:, :k].astype(jnp.int32)  # distinct per token
  w = jax.random.uniform(keys[2], (t, k))
  weights = tuple(jax.random.normal(kk, s) * 0.2 for kk, s in zip(keys[3:], [(e, d, f), (e, d, f), (e, f, d)]))
  return x, w, ids, weights


@functools.partial(jax.jit, static_argnames=("node_local",))
def _local_dispatch(x, w, ids, weights, *, node_local):
  """`LocalDispatch` of the pairs, node-local mode's: only those whose expert is on the token's node (token t on
  node t // (T / 2), expert e on node e // (E / 2))."""
  e, t = weights[0].shape[0], x.shape[0]
  if node_local:
    w = jnp.where(locality.expert_nodes(e, 2)[ids] == locality.simulated_token_nodes(t, 1, 2)[:, None], w, 0.0)
  wg, wu, wd = weights
  return dispatch.LocalDispatch()(x, w, ids, functools.partial(experts.swiglu_experts, w_gate=wg, w_up=wu, w_down=wd),
                                  e)


@pytest.mark.parametrize("node_local", [False, True])
def test_dispatch_transports_agree_with_local_dispatch(node_local):
  """Padded and ragged (emulated collective) transports equal `LocalDispatch`; node-local mode computes exactly
  the pairs whose expert is on the token's node."""
  x, w, ids, weights = _dispatch_inputs(jax.random.key(3), e=16, d=32, f=24, t=64, k=3)
  mesh = meshes.make_mesh(layout="2x4")
  expect = _local_dispatch(x, w, ids, weights, node_local=node_local)
  got, hlo = _run_dispatch(ep.ExpertParallelDispatch(2, 4, node_local, "padded"), mesh, x, w, ids, weights, hlo=True)
  np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
  summary = hc.summarize(hlo, meshes.device_nodes(mesh))
  assert summary["n_collectives"] >= 3 and (summary["n_cross_node"] == 0) == node_local
  got = _run_dispatch(ep.ExpertParallelDispatch(2, 4, node_local, "ragged_emulated"), mesh, x, w, ids, weights)
  np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)


def test_small_capacity_is_counted_and_never_silent():
  e, d, f, t, k = 8, 16, 8, 32, 2
  x, _, _, weights = _dispatch_inputs(jax.random.key(4), e=e, d=d, f=f, t=t, k=k)  # its own ids and weights below
  ids = np.stack([np.zeros((t,), np.int32), np.ones((t,), np.int32)], axis=1)  # all to device 0 and 1
  w = np.full((t, k), 0.5, np.float32)
  mesh = meshes.make_mesh(layout="2x4")
  full = _run_dispatch(ep.ExpertParallelDispatch(2, 4), mesh, x, w, ids, weights)
  assert np.isfinite(np.asarray(full)).all()
  small = np.asarray(_run_dispatch(ep.ExpertParallelDispatch(2, 4, capacity=2), mesh, x, w, ids, weights))
  per_device = np.asarray(ids).reshape(8, -1)
  count = jax.jit(functools.partial(ep.capacity_overflow, n_experts=e, n_devices=8, capacity=2))
  overflow = sum(int(count(r)) for r in per_device)
  assert overflow == 8 * 2 * 2  # each device: 4 tokens, 2 fit per destination, for 2 destinations
  bad_tokens = ~np.isfinite(small).all(axis=1)
  assert bad_tokens.sum() == 8 * 2  # every token with a dropped pair is NaN ...
  np.testing.assert_allclose(small[~bad_tokens], np.asarray(full)[~bad_tokens], rtol=1e-5, atol=1e-5)  # ... others exact


def test_a_node_local_overflow_counts_only_the_pairs_it_sends(model):
  """A node-local dispatch sends only pairs whose expert is on the token's node: `capacity_overflow(node=)` counts
  those (before: every pair, 32 where 16 overflowed), and a ragged transport refuses a capacity it would ignore."""
  e, d, f, t, k = 8, 16, 8, 32, 2
  x, _, _, weights = _dispatch_inputs(jax.random.key(4), e=e, d=d, f=f, t=t, k=k)
  ids = np.stack([np.zeros((t,), np.int32), np.ones((t,), np.int32)], axis=1)  # experts of devices 0, 1 (node 0)
  w = np.full((t, k), 0.5, np.float32)
  mesh = meshes.make_mesh(layout="2x4")
  small = np.asarray(_run_dispatch(ep.ExpertParallelDispatch(2, 4, True, capacity=2), mesh, x, w, ids, weights))
  count = jax.jit(functools.partial(ep.capacity_overflow, n_experts=e, n_devices=8, capacity=2, n_nodes=2),
                  static_argnames=("node",))
  overflow = sum(int(count(r, node=device // 4)) for device, r in enumerate(np.asarray(ids).reshape(8, -1)))
  assert overflow == 4 * 2 * 2  # node 0's 4 devices: 4 tokens, 2 fit per destination, 2 destinations; node 1: none
  assert (~np.isfinite(small).all(axis=1)).sum() == 4 * 2
  with pytest.raises(ValueError, match=r"node=2 must be in \[0, n_nodes=2\)"):
    ep.capacity_overflow(ids, n_experts=e, n_devices=8, capacity=2, node=2, n_nodes=2)
  for transport in ("ragged", "ragged_emulated"):
    with pytest.raises(ValueError, match=f"capacity=2 sizes the padded transport's buffers; transport='{transport}'"):
      ep.ExpertParallelDispatch(2, 4, transport=transport, capacity=2)
  with pytest.raises(ValueError, match="sizes the padded transport's buffers"):
    runner.shard(model, mesh, transport="ragged_emulated", capacity=2)


def test_ragged_transport_lowers_to_ragged_all_to_all():
  """XLA:CPU cannot compile ragged-all-to-all, but the GPU variant must trace and lower to it (the bookkeeping
  around it is checked numerically through the emulated collective above)."""
  e, d, f, t, k = 16, 8, 8, 8, 2
  mesh = meshes.make_mesh(layout="2x4")
  args = (jnp.zeros((t, d)), jnp.zeros((t, k)), jnp.zeros((t, k), jnp.int32), jnp.zeros((e, d, f)),
          jnp.zeros((e, d, f)), jnp.zeros((e, f, d)))
  both = ("node", "local")
  for node_local in (False, True):
    body = functools.partial(_dispatch_body, dispatcher=ep.ExpertParallelDispatch(2, 4, node_local, "ragged"),
                             n_experts=e)
    f_ = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(both),) * 6, out_specs=P(both), check_vma=False))
    text = f_.lower(*args).as_text()
    assert text.count("ragged_all_to_all") >= 3  # dispatch rows, their expert ids, and the combine


def test_interpreted_mosaic_experts_are_refused_inside_a_multi_device_shard_map(model):
  """Mosaic GPU expert kernels run in interpret mode off the GPU, whose per-device barriers crashed ("Barrier remains
  allocated", 1x2) or hung with every device thread waiting (2x4) inside shard_map; now named at shard()."""
  from moe_jax import quant  # pylint: disable=g-import-not-at-top
  wide = decode.init_model(model.config.replace(d_model=128, expert_hidden=128), seed=0)  # the kernel's K, N tiles
  mgpu = quant.to_mgpu_layout(quant.quantize_experts(wide, "int4"))
  quant.set_implementation(mgpu, "pallas")
  with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.w_gate is 'int4_mgpu', run by a Mosaic GPU kernel"):
    runner.shard(mgpu, meshes.make_mesh(layout="1x2"))
  quant.set_implementation(mgpu, "xla")
  runner.shard(mgpu, meshes.make_mesh(layout="1x2"))  # the XLA route shards as before


def test_interpreted_mosaic_kv_cache_is_refused_inside_a_multi_device_shard_map(model, tokens):
  """kv_cache="oskvp_uniform" with implementation="pallas" decodes through the Mosaic GPU OS-KVP core, in interpret
  mode off the GPU. Inside the "ep" shard_map on 2x4 its decode step crashed deep in the interpreter ("Barrier remains
  allocated", 27 s in) while the XLA implementation matched the unsharded model (1.4e-6) and layout="ep_tp" ran the
  interpreted core (1.3e-6); now sharded prefill and decode_step name the cache mode before anything compiles."""
  from moe_jax.kv_cache import register_kv_cache_mode  # pylint: disable=g-import-not-at-top
  from moe_jax.kv_quant import OSKVPMode  # pylint: disable=g-import-not-at-top
  wide = decode.init_model(model.config.replace(head_dim=128, max_seq_len=64), seed=0)  # the core's head dim
  lengths = np.array([12, 5, 9, 12, 1, 7, 12, 3], np.int32)
  for impl in ("pallas", "xla"):
    register_kv_cache_mode(f"oskvp_uniform_{impl}_test", OSKVPMode(uniform=True, window=8, implementation=impl))
  mesh = meshes.make_mesh(layout="2x4")
  sm = runner.shard(wide, mesh)
  match = (r"kv_cache='oskvp_uniform_pallas_test' decodes layer 0 through the Mosaic GPU core "
           r"\(implementation='pallas'\), which off the GPU runs in interpret mode and cannot run on 8 cpu devices")
  with pytest.raises(ValueError, match=match):
    sm.prefill(tokens, lengths, kv_cache="oskvp_uniform_pallas_test", cache_len=64)
  cache = jax.eval_shape(lambda: decode.prefill(wide, tokens, lengths, kv_cache="oskvp_uniform_pallas_test",
                                                cache_len=64)[1])  # a cache built elsewhere, abstract
  with pytest.raises(ValueError, match=match):
    sm.decode_fn(cache)
  runner._check_interpreted_mosaic_cache(cache, mesh, "ep_tp", wide.config.n_heads)  # pylint: disable=protected-access
  xla = jax.eval_shape(lambda: decode.prefill(wide, tokens, lengths, kv_cache="oskvp_uniform_xla_test",
                                              cache_len=64)[1])
  runner._check_interpreted_mosaic_cache(xla, mesh, "ep", wide.config.n_heads)  # pylint: disable=protected-access


def test_a_donating_decode_step_updates_its_cache_in_place_and_matches(model, tokens):
  """`decode_fn(cache, donate=True)` (the timed loop of sharding.experiments) is its own jitted step that consumes
  its cache argument; its logits and cache equal the plain step's, which leaves its cache usable."""
  sm = runner.shard(model, meshes.make_mesh(layout="2x4"))
  lengths = jnp.array([12, 5, 9, 12, 1, 7, 12, 3], jnp.int32)
  nxt = sm.put(jax.random.randint(jax.random.key(14), (8,), 0, 256), P(rules.RULES["ep"]["batch"]))
  _, cache = sm.prefill(tokens, lengths, kv_cache="fp32", cache_len=16)
  plain, donating = sm.decode_fn(cache), sm.decode_fn(cache, donate=True)
  assert plain is not donating and sm.decode_fn(cache, donate=True) is donating
  want, want_cache = plain(sm.state, cache, nxt)
  copy = jax.tree_util.tree_map(jnp.copy, cache)
  got, got_cache = donating(sm.state, copy, nxt)
  assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(copy))  # donated: its buffers are the new cache's
  np.testing.assert_allclose(got, want, **TOL)
  for a, b in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(want_cache)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(plain(sm.state, cache, nxt)[0], want, **TOL)  # the plain step's input is intact
