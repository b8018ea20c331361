"""Checks shared by the OS-KVP refit tests (`test_oskvp_refit_batched.py`, `test_oskvp_refit_across_layers.py`)."""

import numpy as np


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
