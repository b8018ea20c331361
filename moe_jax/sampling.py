"""Next-token sampling from logits with per-sequence parameters: greedy, temperature, top-k, top-p.

Everything is a traced array, so one compiled step serves a batch whose rows use different settings (the serving
engine relies on that). Validate parameters on the host with `SamplingParams` before they reach jit.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)  # the per-row arrays are float32 / int32
_I32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Host-side sampling settings of one request.

  Attributes:
    temperature: 0 for greedy; > 0 to sample.
    top_k: keep the k most likely tokens (0: no limit).
    top_p: keep the smallest set whose probability reaches top_p, in (0, 1].
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))  # numpy scalars too
    if not (real(self.temperature) and 0 <= self.temperature <= _F32_MAX):
      raise ValueError(f"temperature={self.temperature!r} must be a number in [0, {_F32_MAX:.3g}] (float32)")
    if not (isinstance(self.top_k, numbers.Integral) and real(self.top_k) and 0 <= self.top_k <= _I32_MAX):
      raise ValueError(f"top_k={self.top_k!r} must be an int in [0, {_I32_MAX}] (0 disables it)")
    if not (real(self.top_p) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
    for name, cast in (("temperature", float), ("top_k", int), ("top_p", float)):  # plain Python values
      object.__setattr__(self, name, cast(getattr(self, name)))

  def arrays(self, batch: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Broadcasts to per-row arrays: temperature f32 [B], top_k int32 [B], top_p f32 [B]."""
    return (jnp.full((batch,), self.temperature, jnp.float32), jnp.full((batch,), self.top_k, jnp.int32),
            jnp.full((batch,), self.top_p, jnp.float32))


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
  """Draws one token per row.

  Args:
    logits: float32 [B, V].
    key: PRNG key.
    temperature: f32 [B]; rows with 0 take the argmax.
    top_k: int32 [B]; 0 keeps all.
    top_p: f32 [B] in (0, 1].
    (A scalar stands for every row.)

  Returns:
    int32 [B].
  """
  logits = logits.astype(jnp.float32)
  b = logits.shape[0]
  temperature, top_k, top_p = (jnp.broadcast_to(jnp.asarray(a, t), (b,)) for a, t in
                               ((temperature, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32)))
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  # One Gumbel draw per vocabulary entry, in vocabulary order, for both paths below (Gumbel-max): a row that filters
  # nothing gets the same token whichever path its batch takes.
  noise = jax.random.gumbel(key, logits.shape, jnp.float32)

  def whole_rows():  # no row drops a token: a draw over each whole row, no sort
    return jnp.argmax(scale_logits(logits, temperature) + noise, axis=-1).astype(jnp.int32)

  def sorted_rows():
    order, candidates = sorted_candidates(logits, temperature, top_k, top_p)
    choice = jnp.argmax(candidates + jnp.take_along_axis(noise, order, axis=-1), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  # The sort is most of the cost (H100, V = 151936, B = 128: 2.5 ms against 0.21 for a whole-row draw,
  # benchmarks/results/sampling_cost_*): only a batch with a row that filters takes it. (Under a vmap over the
  # per-row settings the cond becomes a select and both paths run.)
  filters = (temperature > 0) & (((top_k != 0) & (top_k < logits.shape[-1])) | (top_p < 1))
  sampled = jax.lax.cond(jnp.any(filters), sorted_rows, whole_rows)
  return jnp.where(temperature > 0, sampled, greedy)


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """f32 [B, V] logits, temperature f32 [B] -> (logits − the row's max) / temperature: any temperature > 0 as given,
  the top token at 0 so that a tiny one cannot overflow it (the others go to −inf: greedy in the limit). Rows at 0
  are divided by 1 (their draw is not used). Before, temperatures under 1e-6 were taken as 1e-6."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows all −inf or with +inf keep their logits
  return (logits - top) / jnp.where(temperature > 0, temperature, 1.0)[:, None]


def sorted_candidates(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                      top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """What `sample` draws from: (order int32 [B, V], most likely first; the temperature-scaled logits in that order,
  -inf where top-k or top-p drops the token)."""
  v = logits.shape[-1]
  scaled = scale_logits(logits.astype(jnp.float32), temperature)
  # [B, V] most likely first, by the logits themselves (the same order for any temperature > 0): at a temperature of
  # ~1e38 the scaled logits all round to 0, and ranking those kept top-k's tokens by vocabulary index.
  order = jnp.argsort(-logits.astype(jnp.float32), axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  # Keep a token while the mass before it is below top_p: the most likely token always stays. top_p = 1 keeps all
  # (in float32 the running sum reaches 1.0 before the tail, which would drop tokens of mass < ~1e-7).
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
  return order, jnp.where(keep, sorted_logits, -jnp.inf)
