"""Serving: continuous batching of many decode streams over one KV cache.

`Engine` (engine.py) holds the slots, the queue and the scheduler; `request.py` validates requests and streams their
tokens back; `steps.py` holds the compiled device functions; `metrics.py` summarises latency and occupancy;
`server.py` serves the engine with the OpenAI completions shape; `equality.py` checks greedy outputs under load
against each request decoded alone (exact in float32, near-ties only in bf16).
"""

from moe_jax.serving.engine import Engine, EngineConfig, EngineStats
from moe_jax.serving.request import (AutoId, CallbackFailed, InvalidRequest, NonFiniteLogits, QueueFull, Request,
                                     RequestFailed, RequestHandle, ServingError)

__all__ = [
    "AutoId", "CallbackFailed", "Engine", "EngineConfig", "EngineStats", "InvalidRequest", "NonFiniteLogits",
    "QueueFull", "Request", "RequestFailed", "RequestHandle", "ServingError",
]
