"""Checks shared by the OS-KVP fit tests (`test_oskvp_refit_batched.py`, `test_oskvp_refit_across_layers.py`,
`test_oskvp_prefill_across_layers.py`)."""

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.kv_quant import OSKVPMode


def layer_kv(layer: int, shape: tuple[int, int, int, int], dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """A layer's keys (two wide channels, a bias) and values of shape [B, T, K, H], different per layer."""
  h = shape[-1]
  std = jnp.ones(h).at[jnp.array([3 + layer, 17])].set(6.0)
  k = jax.random.normal(jax.random.PRNGKey(10 + layer), shape) * std + 0.3 * std
  v = jax.random.normal(jax.random.PRNGKey(20 + layer), shape) * (1.0 + layer)
  return k.astype(dtype), v.astype(dtype)


def counting_fits(monkeypatch) -> list[int]:
  """Patches `OSKVPMode._fit_selected` (every fit of keys and values goes through it: `fit_keys_values`,
  `fit_layers`) to record, when it runs (not when traced), how many rows it fits, in the order the calls ran (which
  need not be the program's)."""
  calls = []
  fit = OSKVPMode._fit_selected  # pylint: disable=protected-access

  def counted(self, k, *args):
    n = k.shape[0]
    jax.debug.callback(lambda: calls.append(n), ordered=True)
    return fit(self, k, *args)

  monkeypatch.setattr(OSKVPMode, "_fit_selected", counted)
  return calls


def assert_same_refits(a, b) -> None:
  """Two OS-KVP layer caches that refitted the same rows in different batches: the same fits up to rounding (U and
  fp8 scales within 1e-4; codebooks within 1e-4 but for 2% of levels, which must be within 0.01: a Lloyd-Max step is
  discontinuous in its samples, so a sample on a cell's edge can move a level), bf16 windows within an ulp, codes
  but for edge cases, and the same counts and flags."""
  for side in ("k", "v"):
    for name in ("u", "scale"):
      np.testing.assert_allclose(getattr(a, f"{name}_{side}"), getattr(b, f"{name}_{side}"), rtol=1e-4, atol=1e-4)
    diff = np.abs(np.asarray(getattr(a, f"cb_{side}")) - np.asarray(getattr(b, f"cb_{side}")))
    assert np.mean(diff > 1e-4) <= 0.02 and diff.max() < 0.01, diff.max()
    np.testing.assert_allclose(*(np.asarray(getattr(c, f"res_{side}"), np.float32) for c in (a, b)), rtol=8e-3,
                               atol=8e-3)
    assert np.mean(np.asarray(getattr(a, f"codes_{side}")) == np.asarray(getattr(b, f"codes_{side}"))) > 0.995
  for name in ("n_comp", "n_res", "refit"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
