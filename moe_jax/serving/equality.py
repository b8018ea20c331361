"""Greedy equality under load: the engine's outputs against each request decoded alone, and the near-tie rule that
tells a bf16 rounding divergence from a bug.

"Alone" means the request is the only row of every computation: its prompt is prefilled as a batch of one, in one
shot, padded to a power-of-two bucket of its own, then decoded greedily as a batch of one, through the model's own
layers (`Block.attn`, `Block.feed_forward`, `Transformer.unembed`), with the engine's cache mode and cache length.
No slots, no shared prefill bucket, no chunking, no other request's tokens in any matmul or MoE group.

In float32 the engine equals alone exactly (tests/moe_jax/serving/test_engine.py). In bf16 both runs compute the same
function with different rounding (the batch size changes GEMM tilings and reduction orders, the MoE's group sizes
depend on the other tokens, long prompts are chunked), so a greedy output may diverge, but only where a discrete
decision of the alone run is nearly tied. The rule checked here, with rho = `RHO` = 2^-7:

  logit near-tie: at the first divergent position j, with a the alone run's token (its top-1), e the engine's token,
    h [D] the alone run's bf16 LM-head input (the final norm's output) and W [D, V] the LM head,
        l_a - l_e <= tau = rho * sum_d |h_d| * |W[d, a] - W[d, e]|.
    Why: the logits are float32 sums of exact bf16 products h_d * W[d, v], so the two runs differ only through h.
    Two bf16 roundings of nearly equal reals differ by at most one ulp, at most 2^-7 of the value (bf16 keeps 8
    significant bits); if every element of h moves by one ulp with the worst signs, l_a - l_e moves by at most tau.
    A gap above tau is not flipped by rounding of the LM-head input. (The alone run's top-1 minus top-2 is <=
    l_a - l_e, so it is below tau too.)
  router near-tie: the MoE's top-k choice is the model's other discrete decision. If the k-th and (k+1)-th router
    logits of a token are within tau_r = rho * sum_d |x_d| * |w[d, e_k] - w[d, e_k+1]| (x [D]: the bf16 router
    input, w [D, E]: the router; the same one-ulp argument), the runs may pick different experts; the token's
    hidden state then jumps by an expert's output, which can flip a token whose logit gap is above tau. A divergence
    that is not a logit near-tie counts as a router near-tie when, at the token that produced position j's logits,
    some MoE layer is within tau_r and switching that layer to its runner-up expert (`router_counterfactual`) makes
    the engine's token a logit near-tie of the alone run (or its top-1).
  Any other divergence is a failure: a wrong cache row, a stale slot, a shifted position, another request's tokens.

The one-ulp premise (upstream rounding differences reach the LM-head input as at most about one ulp) is measured by
`batch_noise`: the same requests decoded in batches, fed the alone run's tokens, and |delta (l_a - l_b)| / tau at
every position, split by whether routing was identical so far.

Shapes: B rows, T prompt bucket, G generated positions (max_new), D model dim, V vocab, L MoE layers, X experts per
token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import routing
from moe_jax.kv_cache import KVCache, before_step, get_kv_cache_mode, prefill_layers
from moe_jax.moe import MoE
from moe_jax.serving import steps
from moe_jax.serving.engine import Engine, EngineConfig
from moe_jax.tokenizer import PAD_ID

RHO = 2.0 ** -7  # one bf16 ulp, relative: the most two roundings of nearly equal values can differ by

LOGIT, ROUTER, UNEXPLAINED = "logit near-tie", "router near-tie", "unexplained"


@dataclasses.dataclass(frozen=True)
class Workload:
  """Greedy requests.

  Attributes:
    prompts: token ids per request.
    max_tokens: tokens to generate per request.
    stop_tokens: stop ids per request (the stop token is emitted, then the request ends).
  """

  prompts: list[list[int]]
  max_tokens: list[int]
  stop_tokens: list[tuple[int, ...]]

  def __len__(self) -> int:
    return len(self.prompts)


def make_workload(n: int, text: np.ndarray, *, max_prompt: int, max_new: int, seed: int = 0,
                  stop_every: int = 4, stop_token: int = ord("\n")) -> Workload:
  """`n` requests: prompts are windows of `text` of uniform length in [1, max_prompt], max_tokens uniform in
  [1, max_new], and every `stop_every`-th request also stops at `stop_token`.

  Args:
    text: int [N] token stream (e.g. bytes of source files), N > max_prompt.
  """
  rng = np.random.default_rng(seed)
  prompts, max_tokens, stops = [], [], []
  for i in range(n):
    length = int(rng.integers(1, max_prompt + 1))
    start = int(rng.integers(0, text.size - length))
    prompts.append([int(t) for t in text[start:start + length]])
    max_tokens.append(int(rng.integers(1, max_new + 1)))
    stops.append((stop_token,) if stop_every and i % stop_every == 0 else ())
  return Workload(prompts, max_tokens, stops)


def run_engine(model, workload: Workload, config: EngineConfig) -> dict:
  """Submits every request at once (the queue holds them all) and runs the engine until idle.

  Returns:
    dict: tokens (list per request), status, finish_reason, ends (times each request's on_finish fired),
    max_active (most slots decoded together), decode_steps, traces_after_warmup.
  """
  if config.max_queue < len(workload):
    raise ValueError(f"max_queue={config.max_queue} must hold all {len(workload)} requests")
  engine = Engine(model, config)
  engine.warmup()
  before = steps.total_traces()
  ends = [0] * len(workload)

  def finished(handle):
    ends[handle.request_id] += 1

  handles = [engine.submit(p, max_tokens=m, stop_tokens=s, request_id=i, on_finish=finished)
             for i, (p, m, s) in enumerate(zip(workload.prompts, workload.max_tokens, workload.stop_tokens))]
  engine.run_until_idle()
  return dict(tokens=[list(h.tokens) for h in handles], status=[h.status for h in handles],
              finish_reason=[h.finish_reason for h in handles], ends=ends,
              max_active=max(engine.stats.active_per_step, default=0), decode_steps=engine.stats.decode_steps,
              traces_after_warmup=steps.total_traces() - before)


# ---------------------------------------------------------------------------------------------- the traced decode


def _moe_index(model) -> dict[int, int]:
  """Block index -> index among the MoE blocks (the L axis of the router statistics)."""
  moe = [i for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoE)]
  return {b: l for l, b in enumerate(moe)}


def check_unbiased_router(model) -> None:
  """The router near-tie rule compares router logits, which rank experts as the selection does only without a
  selection bias, and the trace routes as `MoE` does (an LCVC layer's penalty and surrogates it would ignore)."""
  from moe_jax.locality import LCVCMoE  # pylint: disable=g-import-not-at-top
  for i, b in enumerate(model.blocks):
    if isinstance(b.ffn, LCVCMoE):
      raise ValueError(f"block {i} is LCVC-routed; the near-tie trace re-routes with plain routing and would compare "
                       "the engine against another model")
    if isinstance(b.ffn, MoE) and bool(jnp.any(b.ffn.router_bias[...] != 0)):
      raise ValueError(f"block {i} has a non-zero router selection bias; the near-tie rule assumes none")


def _lm_head(model) -> jax.Array:
  """[D, V]."""
  return model.embedding[...].T if model.lm_head is None else model.lm_head[...]


def _pair_tau(h: jax.Array, w_t: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """rho * sum_d |h_d| |w[a, d] - w[b, d]|: h [..., D] bf16, w_t [V or E, D], a, b int [...] -> float32 [...]."""
  diff = jnp.abs(jnp.take(w_t, a, axis=0).astype(jnp.float32) - jnp.take(w_t, b, axis=0).astype(jnp.float32))
  return RHO * jnp.sum(jnp.abs(h.astype(jnp.float32)) * diff, axis=-1)


def _route(block, x: jax.Array):
  """Router statistics of a block's tokens, computed as the MoE computes its choice.

  Args:
    x: [B, T, D] residual stream after attention (the feed-forward's input).

  Returns:
    (ids int32 [B, T, X] chosen experts, margin float32 [B, T] k-th minus (k+1)-th router logit, tau_r float32
    [B, T]); None for a dense block.
  """
  moe = block.ffn
  if not isinstance(moe, MoE):
    return None
  r = block.ffn_norm(x)  # the router's bf16 input
  b, t, d = r.shape
  logits = routing.router_logits(r.reshape(b * t, d), moe.w_router[...])  # [BT, E]
  vals, ids = jax.lax.top_k(logits, moe.k + 1)
  tau = _pair_tau(r.reshape(b * t, d), moe.w_router[...].T, ids[:, moe.k - 1], ids[:, moe.k])
  return (ids[:, :moe.k].reshape(b, t, moe.k), (vals[:, moe.k - 1] - vals[:, moe.k]).reshape(b, t),
          tau.reshape(b, t))


def _feed_forward(block, x: jax.Array, flip: jax.Array) -> jax.Array:
  """`block.feed_forward(x)`, except that where `flip` [B, T] is set the MoE's k-th expert is replaced by its
  (k+1)-th (the runner-up choice a rounding difference could have made). For an MoE block this writes
  `Block.feed_forward` and `MoE.__call__` out: the same router, selection, weights, dispatch and shared expert, so
  unflipped tokens get the model's values (one compiled trace serves the alone runs and the counterfactuals)."""
  if not isinstance(block.ffn, MoE):
    return block.feed_forward(x)[0]
  moe = block.ffn
  h = block.ffn_norm(x)
  b, t, d = h.shape
  tokens = h.reshape(b * t, d)
  logits = routing.router_logits(tokens, moe.w_router[...])  # [BT, E]
  weights, ids = routing.select_experts(logits, k=moe.k, router=moe.router, norm_topk_prob=moe.norm_topk_prob,
                                        selection_bias=moe.router_bias[...])
  probs = routing.affinities(logits, moe.router)
  _, ranked = jax.lax.top_k(probs + moe.router_bias[...], moe.k + 1)  # [BT, X + 1]
  alt_ids = jnp.concatenate([ranked[:, :moe.k - 1], ranked[:, moe.k:]], axis=1).astype(jnp.int32)
  alt_w = jnp.take_along_axis(probs, alt_ids, axis=-1)
  if moe.norm_topk_prob:
    alt_w = alt_w / jnp.maximum(jnp.sum(alt_w, axis=-1, keepdims=True), 1e-20)
  f = flip.reshape(b * t, 1)
  ids, weights = jnp.where(f, alt_ids, ids), jnp.where(f, alt_w, weights)
  y = moe.add_shared(tokens, moe.dispatch(tokens, weights, ids, moe.expert_fn, moe.n_experts))
  return x + y.reshape(b, t, d)


def _stack_routes(routes) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-block `_route` outputs -> ids [B, T, L, X], margin [B, T, L], tau_r [B, T, L] over the MoE blocks."""
  routes = [r for r in routes if r is not None]
  return tuple(jnp.stack([r[i] for r in routes], axis=2) for i in range(3))


@functools.partial(jax.jit, static_argnames=("kv_cache", "cache_len"))
def trace(flat: steps.FlatModel, tokens: jax.Array, lengths: jax.Array, forced: jax.Array, watch: jax.Array,
          n: jax.Array, flips: tuple[jax.Array, jax.Array], *, kv_cache: str, cache_len: int) -> dict:
  """Greedy decode of B rows (prefill, then `n` positions), recording what the near-tie rule needs.

  The computation is `Transformer.prefill` then `Transformer.decode` written out block by block (`_feed_forward`
  for the feed-forward), with the LM-head input and the router logits read on the side; the values are the
  model's.

  Args:
    flat: the model as a `steps.FlatModel`.
    tokens: int32 [B, T] right-padded prompts; lengths: int32 [B].
    forced: int32 [B, G], token taken at each position (-1: the row's own argmax).
    watch: int32 [B, G, 2], two tokens whose logits are recorded at each position.
    n: int32 scalar, positions to decode (<= G); later positions are left zero.
    flips: (bool [B, T, L], bool [B, G, L]), counterfactual routing: the k-th expert of MoE layer l replaced by
      the runner-up at prompt token t / at the token fed at position g (see `_feed_forward`); all False: the
      model as it is.

  Returns:
    dict of arrays: tokens int32 [B, G] (taken), top int32 [B, G, 2] and top_logits float32 [B, G, 2] (top-1,
    top-2), tau_top float32 [B, G] (tau of the top-1/top-2 pair), watch_logits float32 [B, G, 2], tau_watch
    float32 [B, G] (tau of top-1 against watch[..., 0]); router statistics of the token that produced each
    position's logits: route_ids int32 [B, G, L, X], route_margin and route_tau float32 [B, G, L]; and of every
    prompt token: prompt_route_ids int32 [B, T, L, X], prompt_route_margin, prompt_route_tau float32 [B, T, L].
  """
  model = flat.unflatten()
  mode = get_kv_cache_mode(kv_cache, model.config)
  b, t = tokens.shape
  g = forced.shape[1]
  w_t = _lm_head(model).T  # [V, D]

  # Prefill, as Transformer.prefill (Block.__call__ per block).
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
  x = model.embed(tokens)
  kvs, routes = [], []
  moe_index = _moe_index(model)
  for i, block in enumerate(model.blocks):
    a, kv = block.attn(block.attn_norm(x), positions)
    routes.append(_route(block, x + a))
    x = _feed_forward(block, x + a, flips[0][:, :, moe_index[i]] if i in moe_index else None)
    kvs.append(kv)
  logits = model.unembed(x)
  layers = prefill_layers(mode, kvs, lengths, cache_len)
  cache = KVCache(layers=layers, lengths=lengths.astype(jnp.int32), mode=kv_cache)
  last = lambda a: jnp.take_along_axis(a, (lengths - 1).reshape((b, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]  # noqa
  p_ids, p_margin, p_tau = _stack_routes(routes)
  lg, h = last(logits), last(model.final_norm(x))  # [B, V], [B, D]
  r_ids, r_margin, r_tau = last(p_ids), last(p_margin), last(p_tau)

  n_moe = p_margin.shape[2]
  out = dict(tokens=jnp.zeros((b, g), jnp.int32), top=jnp.zeros((b, g, 2), jnp.int32),
             top_logits=jnp.zeros((b, g, 2), jnp.float32), tau_top=jnp.zeros((b, g), jnp.float32),
             watch_logits=jnp.zeros((b, g, 2), jnp.float32), tau_watch=jnp.zeros((b, g), jnp.float32),
             route_ids=jnp.zeros((b, g, n_moe, p_ids.shape[3]), jnp.int32),
             route_margin=jnp.zeros((b, g, n_moe), jnp.float32), route_tau=jnp.zeros((b, g, n_moe), jnp.float32))

  def body(j, carry):
    cache, lg, h, r_ids, r_margin, r_tau, out = carry
    top_logits, top = jax.lax.top_k(lg, 2)  # [B, 2]
    tok = jnp.where(forced[:, j] >= 0, forced[:, j], top[:, 0]).astype(jnp.int32)
    rows = dict(tokens=tok, top=top, top_logits=top_logits, tau_top=_pair_tau(h, w_t, top[:, 0], top[:, 1]),
                watch_logits=jnp.take_along_axis(lg, watch[:, j], axis=1),
                tau_watch=_pair_tau(h, w_t, top[:, 0], watch[:, j, 0]), route_ids=r_ids, route_margin=r_margin,
                route_tau=r_tau)
    out = {k: v.at[:, j].set(rows[k]) for k, v in out.items()}
    # One decode step, as Transformer.decode (Block.decode per block).
    x = model.embed(tok[:, None])
    positions = cache.lengths[:, None]
    layers, routes = [], []
    for i, (block, layer_cache) in enumerate(zip(model.blocks, before_step(cache.layers))):
      a, layer_cache = block.attn.decode(block.attn_norm(x), positions, layer_cache)
      routes.append(_route(block, x + a))
      x = _feed_forward(block, x + a, flips[1][:, j, moe_index[i]][:, None] if i in moe_index else None)
      layers.append(layer_cache)
    cache = cache.replace(layers=tuple(layers), lengths=cache.lengths + 1)
    r_ids, r_margin, r_tau = (a[:, 0] for a in _stack_routes(routes))
    return cache, model.unembed(x)[:, 0], model.final_norm(x)[:, 0], r_ids, r_margin, r_tau, out

  carry = jax.lax.fori_loop(0, n, body, (cache, lg, h, r_ids, r_margin, r_tau, out))
  return dict(carry[-1], prompt_route_ids=p_ids, prompt_route_margin=p_margin, prompt_route_tau=p_tau)


def bucket(length: int, smallest: int = 16) -> int:
  """The power-of-two prompt bucket (>= smallest) a prompt of `length` tokens is padded to."""
  return max(smallest, 1 << (max(length, 1) - 1).bit_length())


def _no_flips(model, b: int, t: int, g: int) -> tuple[np.ndarray, np.ndarray]:
  n_moe = len(_moe_index(model))
  return np.zeros((b, t, n_moe), bool), np.zeros((b, g, n_moe), bool)


def _padded(prompts: Sequence[Sequence[int]], t: int) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.full((len(prompts), t), PAD_ID, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, np.array([len(p) for p in prompts], np.int32)


def run_alone(model, workload: Workload, engine_tokens: Sequence[Sequence[int]], *, kv_cache: str, cache_len: int,
              max_new: int, smallest_bucket: int = 16) -> list[dict]:
  """Each request decoded alone (a batch of one), greedy, for its max_tokens positions.

  Args:
    engine_tokens: the engine's output per request; its logit is recorded at each position (watch) to measure the
      engine token's deficit at a divergence.
    max_new: G, the static position count (>= every max_tokens).

  Returns:
    one dict of numpy arrays per request (`trace`'s outputs without the batch axis, cut to max_tokens positions
    and to the prompt's length) and its prompt bucket ("bucket").
  """
  check_unbiased_router(model)
  flat = steps.FlatModel.of(model)
  pending = []
  for prompt, m, eng in zip(workload.prompts, workload.max_tokens, engine_tokens):
    tokens, lengths = _padded([prompt], bucket(len(prompt), smallest_bucket))
    watch = np.zeros((1, max_new, 2), np.int32)
    watch[0, :len(eng)] = np.asarray(eng, np.int32)[:, None]
    pending.append(trace(flat, tokens, lengths, np.full((1, max_new), -1, np.int32), watch, np.int32(m),
                         _no_flips(model, 1, tokens.shape[1], max_new), kv_cache=kv_cache,
                         cache_len=cache_len))  # dispatched asynchronously
  out = []
  for res, prompt, m in zip(jax.device_get(pending), workload.prompts, workload.max_tokens):
    row = {k: v[0, :m] for k, v in res.items() if not k.startswith("prompt_")}
    row.update({k: v[0, :len(prompt)] for k, v in res.items() if k.startswith("prompt_")})
    row["bucket"] = bucket(len(prompt), smallest_bucket)
    out.append(row)
  return out


def expected_tokens(alone_tokens: Sequence[int], stop_tokens: Sequence[int]) -> list[int]:
  """The alone run's output as the engine returns it: cut after the first stop token."""
  out = []
  for t in alone_tokens:
    out.append(int(t))
    if t in stop_tokens:
      break
  return out


def router_counterfactual(flat: steps.FlatModel, prompt: Sequence[int], row: dict, j: int, engine_token: int,
                          layer: int, *, kv_cache: str, cache_len: int, max_new: int) -> dict:
  """The alone run again up to position j, with MoE layer `layer` at the token that produced position j's logits
  switched to its runner-up expert: does the engine's token become a logit near-tie (or the top-1)?

  Returns:
    dict: layer, top1_minus_engine and tau at position j under the flipped routing, reproduces (<= tau).
  """
  t = row["bucket"]  # the alone run's shape: the same compiled trace
  tokens, lengths = _padded([prompt], t)
  forced = np.full((1, max_new), -1, np.int32)
  forced[0, :j] = row["tokens"][:j]  # the alone run's prefix
  watch = np.full((1, max_new, 2), engine_token, np.int32)
  n_moe = row["route_margin"].shape[-1]
  flip_prompt, flip_gen = np.zeros((1, t, n_moe), bool), np.zeros((1, max_new, n_moe), bool)
  if j == 0:
    flip_prompt[0, len(prompt) - 1, layer] = True
  else:
    flip_gen[0, j - 1, layer] = True
  res = jax.device_get(trace(flat, tokens, lengths, forced, watch, np.int32(j + 1), (flip_prompt, flip_gen),
                             kv_cache=kv_cache, cache_len=cache_len))
  deficit = float(res["top_logits"][0, j, 0] - res["watch_logits"][0, j, 0])
  tau = float(res["tau_watch"][0, j])
  return dict(layer=layer, top1_minus_engine=deficit, tau=tau, reproduces=deficit <= tau)


def classify(row: dict, j: int, engine_token: int, counterfactual=None) -> dict:
  """The near-tie diagnosis of a divergence at position j of an alone trace `row` (watch = the engine's tokens).

  Args:
    counterfactual: layer -> `router_counterfactual` result; for a divergence that is not a logit near-tie it is
      called on the MoE layers within tau_r at the producing token, nearest tie first, until one reproduces the
      engine's token (None: router near-ties are not examined).
  """
  gap = float(row["top_logits"][j, 0] - row["top_logits"][j, 1])
  deficit = float(row["top_logits"][j, 0] - row["watch_logits"][j, 0])
  tau = float(row["tau_watch"][j])
  ratio = row["route_margin"][j] / np.maximum(row["route_tau"][j], 1e-30)  # [L]
  out = dict(position=j, alone_token=int(row["tokens"][j]), engine_token=engine_token, top1_minus_top2=gap,
             top1_minus_engine=deficit, tau=tau, gap_over_tau=deficit / tau if tau > 0 else float("inf"),
             tau_top=float(row["tau_top"][j]), router_margin_over_tau=[float(r) for r in ratio], kind=LOGIT)
  if deficit <= tau:
    return out
  out["kind"] = UNEXPLAINED
  if counterfactual is not None:
    out["router_flips"] = []
    for layer in np.argsort(ratio):  # the nearest ties first; only layers within tau_r can explain
      if ratio[layer] > 1.0:
        break
      out["router_flips"].append(counterfactual(int(layer)))
      if out["router_flips"][-1]["reproduces"]:
        out["kind"] = ROUTER
        break
  return out


def compare(workload: Workload, engine: dict, alone: list[dict], model=None, *, kv_cache: str = "bf16",
            cache_len: int = 0, max_new: int = 0) -> dict:
  """Engine outputs against the alone runs.

  Args:
    model: for the router counterfactuals of divergences that are not logit near-ties (None: such divergences
      stay unexplained); kv_cache, cache_len, max_new: as given to `run_alone`.

  Returns:
    dict: n, completed_once, exact (count), divergences (list of dicts: request, prompt_len, max_tokens and the
    `classify` fields), kinds (count per kind), and base rates over every alone position (the chance that a
    position picked at random passes as a near-tie): positions, logit_near_tie_rate (top-1/top-2 gap <= tau_top),
    router_near_tie_rate (some MoE layer's margin <= tau_r at the producing token).
  """
  n = len(workload)
  flat = None if model is None else steps.FlatModel.of(model)
  completed_once = sum(engine["ends"][i] == 1 and engine["status"][i] == "finished" for i in range(n))
  divergences, exact = [], 0
  for i in range(n):
    want = expected_tokens(alone[i]["tokens"], workload.stop_tokens[i])
    got = engine["tokens"][i]
    if got == want:
      exact += 1
      continue
    j = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), None)
    d = dict(request=i, prompt_len=len(workload.prompts[i]), max_tokens=workload.max_tokens[i])
    if j is None:  # same tokens, different length: not a rounding effect
      d.update(position=min(len(got), len(want)), kind=UNEXPLAINED, note=f"lengths {len(got)} vs {len(want)}")
    else:
      cf = None if flat is None else functools.partial(
          router_counterfactual, flat, workload.prompts[i], alone[i], j, int(got[j]), kv_cache=kv_cache,
          cache_len=cache_len, max_new=max_new)
      d.update(classify(alone[i], j, int(got[j]), (lambda layer, cf=cf: cf(layer=layer)) if cf else None))
    divergences.append(d)
  logit_tie, router_tie = [], []
  for i in range(n):
    m = len(expected_tokens(alone[i]["tokens"], workload.stop_tokens[i]))
    row = alone[i]
    logit_tie.append((row["top_logits"][:m, 0] - row["top_logits"][:m, 1]) <= row["tau_top"][:m])
    router_tie.append(np.any(row["route_margin"][:m] <= row["route_tau"][:m], axis=-1))
  kinds = {k: sum(d["kind"] == k for d in divergences) for k in (LOGIT, ROUTER, UNEXPLAINED)}
  return dict(n=n, completed_once=int(completed_once), exact=exact, exact_fraction=exact / n,
              divergences=divergences, kinds=kinds, positions=int(np.concatenate(logit_tie).size),
              logit_near_tie_rate=float(np.concatenate(logit_tie).mean()),
              router_near_tie_rate=float(np.concatenate(router_tie).mean()))


def batch_noise(model, workload: Workload, alone: list[dict], *, batch: int, kv_cache: str, cache_len: int,
                max_new: int) -> dict:
  """The rounding noise batching adds: requests decoded `batch` at a time (prompts padded to the group's bucket),
  each row fed its alone run's tokens, and the change of the alone run's top-1 minus top-2 logit, in units of its
  tau, at every position. Positions are split by routing: identical at every token so far ("same routing"), different
  only at earlier tokens ("earlier flip"), different at the token that produced the logits ("flip here").

  Returns:
    dict per split: positions, max, p50, p99, p999 of |delta gap| / tau; and routing_flip_rate (fraction of
    router decisions, prompt and generated tokens, that differ between the runs).
  """
  flat = steps.FlatModel.of(model)
  ratios = {"same routing": [], "earlier flip": [], "flip here": []}
  decisions = n_flips = 0
  for lo in range(0, len(workload), batch):
    idx = list(range(lo, min(lo + batch, len(workload))))
    prompts = [workload.prompts[i] for i in idx]
    t = bucket(max(len(p) for p in prompts))
    tokens, lengths = _padded(prompts + [[PAD_ID]] * (batch - len(idx)), t)  # fixed batch: one compile
    forced = np.zeros((batch, max_new), np.int32)
    watch = np.zeros((batch, max_new, 2), np.int32)
    for r, i in enumerate(idx):
      m = workload.max_tokens[i]
      forced[r, :m] = alone[i]["tokens"]
      watch[r, :m] = alone[i]["top"]
    n = max(workload.max_tokens[i] for i in idx)
    res = jax.device_get(trace(flat, tokens, lengths, forced, watch, np.int32(n),
                               _no_flips(model, batch, t, max_new), kv_cache=kv_cache, cache_len=cache_len))
    for r, i in enumerate(idx):
      a, m, p = alone[i], workload.max_tokens[i], len(workload.prompts[i])
      same = lambda x, y: np.all(np.sort(x, -1) == np.sort(y, -1), axis=-1)  # noqa: E731  [..., L] -> [...]
      prompt_same = same(a["prompt_route_ids"], res["prompt_route_ids"][r, :p]).all(axis=-1)  # [P]
      gen_same = same(a["route_ids"], res["route_ids"][r, :m]).all(axis=-1)  # [m], position j's producing token
      decisions += (p + m - 1) * a["route_ids"].shape[1]
      n_flips += int((~same(a["prompt_route_ids"], res["prompt_route_ids"][r, :p])).sum())
      n_flips += int((~same(a["route_ids"][1:], res["route_ids"][r, 1:m])).sum())
      earlier_ok = np.concatenate([[prompt_same[:-1].all()], gen_same[:-1]])
      earlier_ok = np.logical_and.accumulate(earlier_ok)
      gap_alone = a["top_logits"][:, 0] - a["top_logits"][:, 1]
      gap_batch = res["watch_logits"][r, :m, 0] - res["watch_logits"][r, :m, 1]
      ratio = np.abs(gap_batch - gap_alone) / np.maximum(a["tau_top"], 1e-30)
      for j in range(m):
        split = "flip here" if not gen_same[j] else "same routing" if earlier_ok[j] else "earlier flip"
        ratios[split].append(ratio[j])
  out = {}
  for split, values in ratios.items():
    v = np.asarray(values, np.float64)
    out[split] = dict(positions=int(v.size), **({} if not v.size else dict(
        max=float(v.max()), p50=float(np.quantile(v, 0.5)), p99=float(np.quantile(v, 0.99)),
        p999=float(np.quantile(v, 0.999)))))
  out["routing_flip_rate"] = n_flips / max(decisions, 1)
  return out
