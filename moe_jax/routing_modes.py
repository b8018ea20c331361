"""Routing modes of the evaluation harness (`python -m moe_jax.eval --routing=NAME`), registered on import.

  * "lcvc": LCVC routing over 2 simulated nodes (λ = 1, τ = 0.5) with rank-16 SVD surrogates for the remote experts
    chosen in decode steps (prefill exact) — what a 2-node decode with no cross-node traffic computes.
  * "lcvc_exact": the same routing with remote experts computed exactly (the routing change alone).
  * "lcvc_n4": as "lcvc" over 4 nodes.
Sweeps over λ, τ and the rank: `python -m sharding.experiments`.
"""

from __future__ import annotations

from moe_jax import eval as eval_lib
from moe_jax import locality


def _lcvc(n_nodes: int, rank: int):
  def transform(model):
    lcvc = locality.LCVCConfig(n_nodes=n_nodes, penalty=1.0, threshold=0.5, surrogates=rank > 0)
    return locality.make_lcvc(model, lcvc, rank=rank)
  return transform


eval_lib.ROUTING_MODES.setdefault("lcvc", _lcvc(2, 16))
eval_lib.ROUTING_MODES.setdefault("lcvc_exact", _lcvc(2, 0))
eval_lib.ROUTING_MODES.setdefault("lcvc_n4", _lcvc(4, 16))
