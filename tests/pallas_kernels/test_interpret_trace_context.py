"""A function jitted before the first interpret-mode Pallas call keeps its jit cache entry after it.

Pallas' interpreters import `jax.experimental.pallas.fuser` at their first call, which adds a value to jax's tracing
context; `moe_jax` and `pallas_kernels` load it on import instead (`pallas_kernels/__init__.py`). Each case runs in
a fresh interpreter: in the test process the module is long loaded.
"""

import subprocess
import sys

import pytest

SCRIPT = """
import jax, jax.numpy as jnp
import {package}
traces = []

@jax.jit
def f(x):
  traces.append(1)
  return x + 1

f(jnp.zeros(3))  # traced before any kernel module is loaded (moe_jax loads them lazily)
from pallas_kernels import oskvp_uniform_prologue as pro
from pallas_kernels.oskvp_random import uniform_codebooks
ks = jax.random.split(jax.random.key(0), 2)
q_rot = jax.random.normal(ks[0], (1, 1, 4, 128))
cb = uniform_codebooks(ks[1], (1, 1, 128), outliers=8)
jax.block_until_ready(pro.prologue(q_rot, cb, jnp.full((1, 1, 8), 0.05), jnp.array([5], jnp.int32), interpret=True))
f(jnp.zeros(3))
print("traces", len(traces))
"""


@pytest.mark.parametrize("package", ["moe_jax", "pallas_kernels"])
def test_an_interpreted_kernel_call_leaves_earlier_jits_cached(package):
  """Before: `traces 2` (the second call of f traced and compiled it again)."""
  proc = subprocess.run([sys.executable, "-c", SCRIPT.format(package=package)], capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split()[-2:] == ["traces", "1"], proc.stdout[-500:]
