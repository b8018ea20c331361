"""Low-rank surrogates of routed experts: rank-r factors of each expert's gate/up/down, built offline by SVD.

A surrogate stands in for a remote expert during decode (`moe_jax/locality.py`): it is small enough to replicate on
every node, so a token whose chosen expert lives on another node is served locally, with no collective across nodes.

For one weight W [D_in, D_out] and rank r the surrogate is A [D_in, r] · B [r, D_out]:
  * plain: the truncated SVD of W (best rank-r approximation in Frobenius norm);
  * activation-whitened: with C = E[x xᵀ] the second moment of the weight's inputs on calibration data and
    S = C^{1/2}, the truncated SVD of S·W gives S·W ≈ U_r Σ_r V_rᵀ, and A = S⁻¹ U_r Σ_r, B = V_rᵀ, which minimises
    E‖xᵀ(W − AB)‖² (the output error on inputs like the calibration data) instead of ‖W − AB‖.
The gate and up projections are whitened by the MoE layer's inputs, the down projection by each expert's own hidden
activations silu(x·W_gate)·(x·W_up) over the same calibration tokens (all of them, not only those routed to it).

Shapes: E experts, D model dim, F expert hidden, r rank, n calibration tokens, M rows (token-expert pairs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moe_jax import experts as experts_lib


class Surrogate(nnx.Variable):
  """Low-rank surrogate factors: replicated on every node, not trained."""


@functools.partial(jax.jit, static_argnames=("rank",))
def low_rank(w: jax.Array, rank: int, second_moment: jax.Array | None = None,
             eps: float = 1e-4) -> tuple[jax.Array, jax.Array]:
  """Rank-r factors of one weight.

  Args:
    w: [D_in, D_out].
    rank: r <= min(D_in, D_out).
    second_moment: optional [D_in, D_in] E[x xᵀ] of the inputs; whitens the approximation when given.
    eps: relative ridge added to the second moment so that S is invertible.

  Returns:
    (a float32 [D_in, r], b float32 [r, D_out]) with x·w ≈ (x·a)·b.
  """
  w = w.astype(jnp.float32)
  if second_moment is None:
    u, s, vt = jnp.linalg.svd(w, full_matrices=False)
    return u[:, :rank] * s[:rank], vt[:rank]
  c = second_moment.astype(jnp.float32)
  c = c + eps * jnp.trace(c) / c.shape[0] * jnp.eye(c.shape[0], dtype=jnp.float32)
  evals, evecs = jnp.linalg.eigh(c)
  evals = jnp.maximum(evals, 1e-12)
  sqrt_c = (evecs * jnp.sqrt(evals)) @ evecs.T
  inv_sqrt_c = (evecs / jnp.sqrt(evals)) @ evecs.T
  u, s, vt = jnp.linalg.svd(sqrt_c @ w, full_matrices=False)
  return inv_sqrt_c @ (u[:, :rank] * s[:rank]), vt[:rank]


def _second_moment(x: jax.Array) -> jax.Array:
  """[n, K] -> [K, K] E[x xᵀ] in float32."""
  x = x.astype(jnp.float32)
  return x.T @ x / x.shape[0]


@jax.jit
def _expert_hidden(x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
  """x [n, D], w_gate/w_up [E, D, F] -> [E, n, F] each expert's SwiGLU hidden activations on every token."""
  x = x.astype(jnp.float32)
  g = jnp.einsum("nD,EDF->EnF", x, w_gate.astype(jnp.float32))
  u = jnp.einsum("nD,EDF->EnF", x, w_up.astype(jnp.float32))
  return jax.nn.silu(g) * u


@functools.partial(jax.jit, static_argnames=("rank", "dtype"))
def _factors(w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, calibration: jax.Array | None, *, rank: int,
             dtype) -> tuple[jax.Array, ...]:
  """`LowRankExperts`' factors as one program: (gate_a, gate_b, up_a, up_b, down_a, down_b) in dtype."""
  if calibration is None:
    factor = jax.vmap(lambda w: low_rank(w, rank))
    (ga, gb), (ua, ub), (da, db) = factor(w_gate), factor(w_up), factor(w_down)
  else:
    cx = _second_moment(calibration)
    factor_in = jax.vmap(lambda w: low_rank(w, rank, cx))
    (ga, gb), (ua, ub) = factor_in(w_gate), factor_in(w_up)
    h = _expert_hidden(calibration, w_gate, w_up)  # [E, n, F]
    ch = jax.vmap(_second_moment)(h)  # [E, F, F]
    da, db = jax.vmap(lambda w, c: low_rank(w, rank, c))(w_down, ch)
  return tuple(a.astype(dtype) for a in (ga, gb, ua, ub, da, db))


class LowRankExperts(nnx.Module):
  """Rank-r surrogates of one MoE layer's E experts, callable like the layer's `expert_fn`.

  Attributes:
    gate_a, up_a: [E, D, r]; gate_b, up_b: [E, r, F]; down_a: [E, F, r]; down_b: [E, r, D] (all `Surrogate`).
    rank: r.
  """

  def __init__(self, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, rank: int,
               calibration: jax.Array | None = None, dtype=None):
    """Builds the factors.

    Args:
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] of the layer.
      rank: r, 1 <= r <= min(D, F).
      calibration: optional [n, D] inputs of the layer (after its RMSNorm) to whiten the approximation.
      dtype: storage dtype of the factors (default the weights' dtype).
    """
    e, d, f = w_gate.shape
    if not 1 <= rank <= min(d, f):
      raise ValueError(f"rank={rank} must be in [1, min(D={d}, F={f})]")
    if calibration is not None:  # before: an empty one gave 0/0 second moments and NaN factors, with no error
      if calibration.ndim != 2 or calibration.shape[0] < 1 or calibration.shape[1] != d:
        raise ValueError(f"calibration must be [n >= 1, D={d}] layer inputs, got shape {tuple(calibration.shape)}")
      if not isinstance(calibration, jax.core.Tracer) and not bool(jnp.isfinite(calibration).all()):
        raise ValueError("calibration holds non-finite values (e.g. token ids outside the vocabulary upstream)")
    ga, gb, ua, ub, da, db = _factors(w_gate, w_up, w_down, calibration, rank=rank, dtype=dtype or w_gate.dtype)
    self.rank = rank
    self.gate_a, self.gate_b = Surrogate(ga), Surrogate(gb)
    self.up_a, self.up_b = Surrogate(ua), Surrogate(ub)
    self.down_a, self.down_b = Surrogate(da), Surrogate(db)

  def __call__(self, x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The `expert_fn` contract: x_sorted [M, D] rows sorted by expert, group_sizes int32 [E] -> [M, D]."""

    def mm(lhs, rhs):
      return experts_lib.grouped_matmul(lhs.astype(x_sorted.dtype), rhs[...], group_sizes)

    gate = mm(mm(x_sorted, self.gate_a), self.gate_b)
    up = mm(mm(x_sorted, self.up_a), self.up_b)
    h = jax.nn.silu(gate) * up  # [M, F]
    return mm(mm(h, self.down_a), self.down_b).astype(x_sorted.dtype)

  def nbytes(self) -> int:
    return sum(int(v[...].nbytes) for v in (self.gate_a, self.gate_b, self.up_a, self.up_b, self.down_a,
                                             self.down_b))


def nbytes_per_layer(n_experts: int, d_model: int, expert_hidden: int, rank: int, bytes_per_element: float) -> float:
  """Bytes of one layer's surrogates: E · r · 3 · (D + F) elements."""
  return n_experts * rank * 3 * (d_model + expert_hidden) * bytes_per_element


def rank_for_budget(n_experts: int, d_model: int, expert_hidden: int, n_moe_layers: int, budget_bytes: float,
                    bytes_per_element: float = 2.0) -> int:
  """The largest rank whose surrogates of all experts of all MoE layers fit `budget_bytes` (one replica)."""
  per_rank = n_moe_layers * nbytes_per_layer(n_experts, d_model, expert_hidden, 1, bytes_per_element)
  rank = int(budget_bytes // per_rank)
  if rank < 1:
    raise ValueError(f"budget_bytes={budget_bytes:.0f} is below one rank-1 surrogate set ({per_rank:.0f} bytes)")
  return min(rank, d_model, expert_hidden)


def moe_layer_inputs(model, tokens: jax.Array) -> list[jax.Array]:
  """Calibration activations: the normalised input of every MoE layer for `tokens`.

  Args:
    model: a `moe_jax.model.Transformer`.
    tokens: int32 [B, T].

  Returns:
    One [B·T, D] array per MoE layer, in layer order.
  """
  from moe_jax.moe import MoE  # pylint: disable=g-import-not-at-top

  @jax.jit
  def run(model, tokens):
    return [h.reshape(-1, h.shape[-1]) for block, h in zip(model.blocks, model.ffn_inputs(tokens))
            if isinstance(block.ffn, MoE)]

  return run(model, jnp.asarray(tokens, jnp.int32))


def build_surrogates(model, rank: int, calibration_tokens: jax.Array | None = None,
                     dtype=None) -> list[LowRankExperts]:
  """One `LowRankExperts` per MoE layer of `model` (whitened when calibration tokens [B, T] are given)."""
  from moe_jax.moe import MoE  # pylint: disable=g-import-not-at-top

  layers = [b.ffn for b in model.blocks if isinstance(b.ffn, MoE)]
  if calibration_tokens is not None:  # checked on the host: an id past the vocabulary embeds as NaN
    from moe_jax import decode  # pylint: disable=g-import-not-at-top
    ids = np.asarray(calibration_tokens)
    if ids.ndim != 2 or 0 in ids.shape or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"calibration_tokens must be a non-empty int [B, T] array, got {ids.dtype} {ids.shape}")
    decode.check_token_ids(model.config, ids)
  inputs = moe_layer_inputs(model, calibration_tokens) if calibration_tokens is not None else [None] * len(layers)
  return [LowRankExperts(*_expert_arrays(m), rank=rank, calibration=x, dtype=dtype) for m, x in zip(layers, inputs)]


def _expert_arrays(moe) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(w_gate, w_up, w_down) of a MoE layer as arrays: quantized experts (`moe_jax.quant`) dequantized to float32,
  the weights the layer computes with, so their surrogates approximate the quantized layer."""
  gate, up, down = moe.w_gate[...], moe.w_up[...], moe.w_down[...]
  if getattr(gate, "kind", None) == "int4_mgpu_gate_up":
    gate, up = gate.dequantize_gate_up()
  dense = lambda w: w.dequantize() if hasattr(w, "dequantize") else w  # noqa: E731
  return dense(gate), dense(up), dense(down)
