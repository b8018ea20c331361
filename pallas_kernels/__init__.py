"""moe-jax's Pallas kernels (Triton and Mosaic GPU), one per file with its reference; each also runs in Pallas' CPU
interpreters (`interpret=True`).

Importing the package loads `jax.experimental.pallas.fuser` up front. Pallas' interpreters import it at their first
call, and it registers a value in jax's tracing context (`pallas_fuser_disable_nested_fuse`), so every function
jitted before that first interpreted call missed its jit cache at its next call: traced and compiled again (a
wired OS-KVP decode call took 5.3 s twice, then 1.2 s). Loaded here, the context is complete before any kernel
runs. Lowering for the GPU does not import it. `moe_jax` imports this package on import: it loads the kernels
lazily, sometimes inside a trace.
"""

import jax.experimental.pallas.fuser  # noqa: F401  pylint: disable=unused-import
