"""Argument checks shared by the split-K Triton decode kernels (OS-KVP, KIVI, per-token), run at trace time: what
their tiles and Pallas' Triton lowering cannot take, named before anything is traced into a kernel."""

from __future__ import annotations

import jax.numpy as jnp


def check_kernel_args(*, groups: int, min_rows: int, num_splits, **extents) -> None:
  """Raises ValueError naming what the split-K Triton decode kernels (KIVI, per-token) cannot take: more than
  `min_rows` query heads per kv head and not a power of two (the query tile has max(G, min_rows) rows), num_splits
  not None or an int >= 1, or an empty extent (`extents`: name=length, e.g. S=..., R=...)."""
  if groups > min_rows and groups & (groups - 1):
    raise ValueError(f"G = N / K = {groups} query heads per kv head must be <= {min_rows} or a power of two (the "
                     "query tile's rows)")
  if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
    raise ValueError(f"num_splits={num_splits!r} must be None or an int >= 1")
  for name, size in extents.items():
    if size < 1:
      raise ValueError(f"{name}={size}: the kernel needs at least one slot there (implementation='xla' takes it)")


def check_integer_lengths(**lengths) -> None:
  """Raises ValueError naming a per-row length array (`name=array`) that is not of integers: a kernel would
  truncate floats where the references compare them."""
  for name, x in lengths.items():
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array (tokens per row), got dtype {x.dtype}")


def check_triton_offsets(**arrays) -> None:
  """Raises a ValueError naming any input of 2^31 or more elements.

  Pallas' Triton lowering (jax 0.11.2, `_compute_offsets_from_indices`) indexes an input with int32 element offsets
  unless it is larger than 2^32 bytes, so an 8-bit input of 2^31 to 2^32 elements is read at wrapped offsets: on
  the H200 the per-token int8 kernel at 32 rows × 131072 tokens × 8 kv heads × 128 channels stopped with an
  illegal address (`benchmarks/results/quantized_cache_decode.log`). Larger inputs get int64 offsets but are not
  measured, so every input of 2^31 or more elements is refused.
  """
  for name, x in arrays.items():
    if x.size >= 2**31:
      raise ValueError(f"{name} {tuple(x.shape)} {x.dtype} has {x.size} >= 2^31 elements: the Triton kernel would "
                       "index it with int32 offsets, which wrap. Use implementation='xla', or fewer batch rows per "
                       "call.")
