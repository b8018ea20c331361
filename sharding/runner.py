"""Runs a model on a ("node", "local") mesh: the whole prefill / decode step inside one `shard_map` ("ep" layout), or
`jax.jit` with the rules table's shardings ("ep_tp" layout, the compiler partitions).

Under "ep" every device holds its batch rows (data-parallel attention, its own KV cache rows) and its block of
experts; the only collectives are the ones the expert-parallel dispatch issues. The decode step's dispatch can be
node-local (LCVC with surrogates), which leaves the step with no collective across "node".

Shapes: B batch (global; divisible by the devices that split it), T length, S cache length, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moe_jax import decode
from moe_jax.dispatch import LocalDispatch
from moe_jax.kv_cache import get_kv_cache_mode
from moe_jax.moe import MoE
from sharding import rules
from sharding.expert_parallel import ExpertParallelDispatch
from sharding.meshes import LOCAL, NODE


def with_dispatch(model, dispatch):
  """A copy of `model` whose MoE layers use `dispatch`."""
  model = nnx.clone(model)
  for block in model.blocks:
    if isinstance(block.ffn, MoE):
      block.ffn.dispatch = dispatch
  return model


def _set_surrogates(model, on: bool):
  for block in model.blocks:
    if hasattr(block.ffn, "use_surrogates"):
      if on and getattr(block.ffn, "surrogate", None) is None:
        raise ValueError("surrogate_decode=True needs an LCVC model with surrogates (moe_jax.locality.make_lcvc)")
      block.ffn.use_surrogates = on
    elif on and isinstance(block.ffn, MoE):  # a node-local dispatch would drop its remote experts
      raise ValueError("surrogate_decode=True needs an LCVC model with surrogates (moe_jax.locality.make_lcvc); "
                       "this model's MoE layers route exactly")
  return model


def _check_lcvc_nodes(model, n_nodes: int) -> None:
  for block in model.blocks:
    lcvc = getattr(block.ffn, "lcvc", None)
    if lcvc is not None and lcvc.n_nodes != n_nodes:
      raise ValueError(f"the model's LCVC n_nodes={lcvc.n_nodes} differs from the mesh's node axis "
                       f"({n_nodes}): build the LCVC model for this mesh or a mesh with {lcvc.n_nodes} nodes")


def _interpreted_shard_map(mesh: Mesh, layout: str) -> bool:
  """Whether `layout` runs its steps inside a multi-device shard_map off the GPU, where Mosaic GPU kernels would run
  in their interpreter (which cannot run there)."""
  return layout == "ep" and mesh.size >= 2 and mesh.devices.flat[0].platform != "gpu"


def _check_interpreted_mosaic(model, mesh: Mesh, layout: str) -> None:
  """Refuses Mosaic GPU expert kernels in interpret mode inside a multi-device shard_map (off the GPU): the
  interpreter's per-device barriers crash ("Barrier remains allocated") or hang with every device thread waiting."""
  if not _interpreted_shard_map(mesh, layout):
    return
  for i, block in enumerate(model.blocks):
    ffn = block.ffn
    if getattr(ffn, "implementation", "xla") not in ("pallas", "pallas_fused"):  # (only MoE layers have one)
      continue
    from moe_jax.quant.formats import MGPU_KINDS  # pylint: disable=g-import-not-at-top
    for name in ("w_gate", "w_up", "w_down"):
      kind = getattr(getattr(ffn, name)[...], "kind", None)
      if kind in MGPU_KINDS:
        raise ValueError(f"blocks.{i}.ffn.{name} is {kind!r}, run by a Mosaic GPU kernel, which off the GPU runs in "
                         f"interpret mode and cannot run on {mesh.size} {mesh.devices.flat[0].platform} devices "
                         "inside shard_map: quant.set_implementation(model, 'xla'), keep the int4 / vq2 layout, or "
                         "use layout='ep_tp'")


def _check_interpreted_mosaic_cache(cache, mesh: Mesh, layout: str, n_heads: int) -> None:
  """Refuses a KV cache whose decode attention runs the Mosaic GPU core (`kv_cache="oskvp_uniform"` with
  implementation="pallas", `OSKVPLayerCache.runs_mosaic_core`) in interpret mode inside a multi-device shard_map
  (off the GPU): the interpreter crashed there as with the experts ("Barrier remains allocated", 2x4). `cache`: a
  `KVCache`, concrete or abstract."""
  if not _interpreted_shard_map(mesh, layout):
    return
  for i, layer in enumerate(cache.layers):
    runs_mosaic_core = getattr(layer, "runs_mosaic_core", None)
    if runs_mosaic_core is not None and runs_mosaic_core(n_heads):
      raise ValueError(f"kv_cache={cache.mode!r} decodes layer {i} through the Mosaic GPU core "
                       f"(implementation={layer.implementation!r}), which off the GPU runs in interpret mode and "
                       f"cannot run on {mesh.size} {mesh.devices.flat[0].platform} devices inside shard_map: use "
                       "the mode with implementation='xla' (or 'auto'), or layout='ep_tp'")


# shard_map bodies: the model arrives as (graphdef, this device's block of its state).
def _logits_body(graphdef, state, tokens):
  return nnx.merge(graphdef, state).forward(tokens)[0]


def _prefill_body(graphdef, state, tokens, lengths, *, kv_cache: str, cache_len: int):
  model = nnx.merge(graphdef, state)
  return model.prefill(tokens, lengths, mode=get_kv_cache_mode(kv_cache, model.config), cache_len=cache_len, mode_name=kv_cache)


def _decode_body(graphdef, state, cache, tokens):
  return decode.step_logits(nnx.merge(graphdef, state), cache, tokens)


@dataclasses.dataclass
class ShardedModel:
  """A model placed on a mesh, with jitted `logits`, `prefill` and `decode_step` of `moe_jax.decode`'s signatures.

  Attributes:
    mesh: the ("node", "local") mesh.
    layout: a key of `rules.RULES`.
    state: the model's parameters, placed by the rules table.
    prefill_def, decode_def: graph definitions of the prefill (exact dispatch) and decode step models.
    config: the model's `ModelConfig`.
  """

  mesh: Mesh
  layout: str
  state: Any
  state_specs: Any
  prefill_def: Any
  decode_def: Any
  config: Any  # the model's ModelConfig, for the input checks
  _cache: dict = dataclasses.field(default_factory=dict)

  def _batch(self):
    return rules.RULES[self.layout]["batch"]

  def _shard_map(self, name, body, in_specs, out_specs):
    if name not in self._cache:
      if self.layout == "ep":
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
      else:
        fn = body
      self._cache[name] = jax.jit(fn)
    return self._cache[name]

  def put(self, x, spec: P):
    """`x` placed on the mesh by `spec`; its batch (leading) axis must divide over the devices that split it."""
    x = jnp.asarray(x)
    axes, devices = rules.devices_along(self.mesh, spec[0] if len(spec) else None)
    if x.ndim and x.shape[0] % devices:
      raise ValueError(f"the batch ({x.shape[0]} sequences) must be divisible by the {devices} devices of mesh axes "
                       f"{axes} that split it under layout={self.layout!r}")
    return jax.device_put(x, NamedSharding(self.mesh, spec))

  def logits(self, tokens) -> jax.Array:
    """int32 [B, T] -> float32 [B, T, V] (concrete token ids are checked as by `moe_jax.decode.logits`)."""
    decode.check_logits_tokens(self.config, tokens)
    b = self._batch()
    fn = self._shard_map("logits", functools.partial(_logits_body, self.prefill_def),
                         (self.state_specs, P(b, None)), P(b, None, None))
    return fn(self.state, self.put(jnp.asarray(tokens, jnp.int32), P(b, None)))

  def prefill(self, tokens, lengths, *, kv_cache: str = "fp32", cache_len: int):
    """As `moe_jax.decode.prefill`: (logits [B, T, V], KVCache with batch-sharded leaves)."""
    get_kv_cache_mode(kv_cache)
    decode.validate_prompts(self.config, tokens, lengths, cache_len=cache_len)
    b = self._batch()
    key = ("prefill", kv_cache, cache_len)
    if key not in self._cache:
      body = functools.partial(_prefill_body, self.prefill_def, kv_cache=kv_cache, cache_len=cache_len)
      if self.layout == "ep":
        cache_spec = _cache_spec_like(self, tokens, lengths, kv_cache, cache_len)  # (checks the cache's kernels)
        body = jax.shard_map(body, mesh=self.mesh, in_specs=(self.state_specs, P(b, None), P(b)),
                             out_specs=(P(b, None, None), cache_spec), check_vma=False)
      self._cache[key] = jax.jit(body)
    return self._cache[key](self.state, self.put(jnp.asarray(tokens, jnp.int32), P(b, None)),
                            self.put(jnp.asarray(lengths, jnp.int32), P(b)))

  def decode_fn(self, cache, *, donate: bool = False):
    """The jitted decode step (state, cache, tokens [B]) -> (logits [B, V], cache), for timing and HLO inspection.
    donate=True: a step that donates its cache argument (a timed loop then updates the cache in place instead of
    copying it every step; the cache passed in is consumed)."""
    decode.check_cache(self.config, cache)  # the unsharded step's check: another model's cache ran here
    b = self._batch()
    key = ("decode", jax.tree_util.tree_structure(cache), donate)  # one step per cache mode (its pytree structure)
    if key not in self._cache:
      body = functools.partial(_decode_body, self.decode_def)
      if self.layout == "ep":
        _check_interpreted_mosaic_cache(cache, self.mesh, self.layout, self.config.n_heads)
        cs = rules.cache_specs(cache, self.layout)
        body = jax.shard_map(body, mesh=self.mesh, in_specs=(self.state_specs, cs, P(b)), out_specs=(P(b, None), cs),
                             check_vma=False)
      self._cache[key] = jax.jit(body, donate_argnums=(1,) if donate else ())
    return self._cache[key]

  def decode_step(self, cache, tokens):
    """As `moe_jax.decode.decode_step`: tokens int32 [B] -> (logits [B, V], KVCache with lengths + 1)."""
    tokens = tokens if hasattr(tokens, "shape") else np.asarray(tokens)  # lists too, as before
    decode.check_step_tokens(self.config, cache, tokens)
    b = self._batch()
    return self.decode_fn(cache)(self.state, cache, self.put(jnp.asarray(tokens, jnp.int32), P(b)))

  def decode_hlo(self, cache, tokens) -> str:
    """The compiled decode step's HLO text."""
    b = self._batch()
    fn = self.decode_fn(cache)
    return fn.lower(self.state, cache, self.put(jnp.asarray(tokens, jnp.int32), P(b))).compile().as_text()


def _cache_spec_like(sm: ShardedModel, tokens, lengths, kv_cache, cache_len):
  """Cache PartitionSpecs from the abstract shape of a local (unsharded) prefill, after checking that the cache's
  decode attention can run inside shard_map (`_check_interpreted_mosaic_cache`: refused before any prefill)."""
  del lengths
  model = nnx.merge(sm.prefill_def, sm.state)
  tokens = jnp.asarray(tokens, jnp.int32)
  shape = jax.eval_shape(lambda m, t, l: _prefill_body(*nnx.split(m), t, l, kv_cache=kv_cache, cache_len=cache_len)[1],
                         with_dispatch(model, LocalDispatch()), tokens, jnp.ones(tokens.shape[:1], jnp.int32))
  _check_interpreted_mosaic_cache(shape, sm.mesh, sm.layout, sm.config.n_heads)
  return rules.cache_specs(shape, sm.layout)


def shard(model, mesh: Mesh, *, layout: str = "ep", surrogate_decode: bool = False, transport: str = "padded",
          capacity: int | None = None) -> ShardedModel:
  """Places `model` on `mesh`.

  Args:
    model: a `Transformer` (plain, or routed by LCVC via `moe_jax.locality.with_lcvc`).
    mesh: a ("node", "local") mesh (`sharding.meshes`).
    layout: "ep" (shard_map, expert-parallel, data-parallel attention) or "ep_tp" (jit with shardings).
    surrogate_decode: decode with LCVC surrogates for remote experts and a node-local dispatch (no collective
      across "node"); prefill stays exact. This replaces an LCVC model's own switch (`LCVCConfig.surrogates`,
      `locality.set_surrogates`): the sharded model equals `set_surrogates(model, False)` at prefill and
      `set_surrogates(model, surrogate_decode)` at decode. surrogate_scope="all" (surrogates at prefill too) is
      refused with surrogate_decode=True.
    transport: the expert-parallel dispatch's transport ("padded", "ragged", "ragged_emulated"); layout "ep" only.
    capacity: padded rows per (source, destination); None = dropless worst case; layout "ep", transport "padded"
      only.
  """
  rules.spec((), layout)  # validates the layout name
  n, l = mesh.shape[NODE], mesh.shape[LOCAL]
  _check_lcvc_nodes(model, n)
  _check_interpreted_mosaic(model, mesh, layout)
  if surrogate_decode and any(getattr(getattr(b.ffn, "lcvc", None), "surrogate_scope", None) == "all"
                              for b in model.blocks):
    raise ValueError("surrogate_decode=True with surrogate_scope='all': the sharded prefill is exact, so it would "
                     "differ from the model's; use surrogate_scope='decode'")
  if layout != "ep" and (transport != "padded" or capacity is not None):  # before: ignored
    raise ValueError(f"transport={transport!r} / capacity={capacity!r} set the 'ep' layout's dispatch; "
                     f"layout={layout!r} partitions by the compiler (leave them at 'padded' / None)")
  if layout == "ep" and transport == "ragged" and mesh.devices.flat[0].platform == "cpu":
    raise ValueError("transport='ragged' needs a GPU (XLA:CPU does not implement ragged-all-to-all); on the CPU "
                     "use 'ragged_emulated', which runs the same bookkeeping over a padded all-to-all")
  if layout == "ep":
    prefill_model = _set_surrogates(with_dispatch(model, ExpertParallelDispatch(n, l, False, transport, capacity)),
                                    False)
    decode_model = _set_surrogates(
        with_dispatch(model, ExpertParallelDispatch(n, l, surrogate_decode, transport, capacity)), surrogate_decode)
  else:
    if surrogate_decode:
      raise ValueError("surrogate_decode needs layout='ep' (the compiler-partitioned layout moves tokens itself)")
    prefill_model = decode_model = _set_surrogates(with_dispatch(model, LocalDispatch()), False)
  prefill_def, state = nnx.split(prefill_model)
  decode_def, _ = nnx.split(decode_model)
  specs = rules.tree_specs(state, layout)
  rules.check_divisible(state, specs, mesh, layout)
  state = jax.device_put(state, rules.named(mesh, specs))
  return ShardedModel(mesh=mesh, layout=layout, state=state, state_specs=specs, prefill_def=prefill_def,
                      decode_def=decode_def, config=model.config)
