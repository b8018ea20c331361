"""The package's lazily exported names: each imports, and `dir(moe_jax)` lists them (notebook tab completion)."""

import moe_jax


def test_every_export_imports_and_is_listed():
  assert moe_jax.__all__ and set(moe_jax.__all__) <= set(dir(moe_jax))  # before: dir() missed every lazy name
  for name in moe_jax.__all__:
    assert getattr(moe_jax, name) is not None, name
