"""The chained-call timing program and the copies of benchmarks/chained_timing.py on the CPU (the clocks need a GPU)."""

import jax.numpy as jnp
import numpy as np

from benchmarks import chained_timing as ct


def _make_args(i):
  return jnp.zeros((2,), jnp.float32), jnp.full((4,), float(i), jnp.float32)


def test_calls_rotate_over_copies_or_each_get_their_own_arguments():
  """A call larger than the L2 runs on one copy of its arguments; with own_args each call gets make_args(i)."""
  fn = lambda q, x: x + 0.0 * q[0]
  multi, qs, arg_sets, calls = ct.chained_calls(fn, _make_args, bytes_per_call=ct.L2_BYTES * 4, min_calls=3)
  assert (len(arg_sets), calls) == (1, 3)
  assert [float(o[0]) for o in multi(qs, arg_sets)] == [0.0, 0.0, 0.0]
  multi, qs, arg_sets, calls = ct.chained_calls(fn, _make_args, bytes_per_call=ct.L2_BYTES * 4, min_calls=3,
                                                own_args=True)
  assert (len(arg_sets), calls) == (3, 3)
  assert [float(o[0]) for o in multi(qs, arg_sets)] == [0.0, 1.0, 2.0]


def test_copies_compute_what_their_bytes_count():
  """x + 1 and x * 2 write an array of x's dtype (read + write), the sum a scalar (read only)."""
  x = jnp.arange(8, dtype=jnp.float32)
  outs = [op(x.astype(dtype), 0.0) for op, dtype, _ in ct.COPIES]
  np.testing.assert_array_equal(outs[0], x + 1)
  assert outs[1].dtype == jnp.bfloat16 and np.array_equal(np.asarray(outs[1], np.float32), 2 * np.asarray(x))
  assert outs[2].shape == () and float(outs[2]) == 28.0
  assert [moved for *_, moved in ct.COPIES] == [8, 4, 4]


def test_the_span_copy_is_none_without_gpu_kernels():
  """On the CPU the profiler trace has no GPU kernels, so there is no span copy figure (and no span column)."""
  assert ct.copy_bandwidth_span(reps=1, n=2**10, calls=2) == (None, None)
