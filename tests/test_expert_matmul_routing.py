"""The group sizes of the expert-matmul benchmarks (`benchmarks/expert_matmul.routed_groups`)."""

import numpy as np
import pytest

from benchmarks import expert_matmul as em


@pytest.mark.parametrize("rows,e", [(64, 64), (512, 64), (1024, 64), (16, 8), (2048, 128), (3, 8)])
def test_routed_groups(rows, e):
  balanced = em.routed_groups(rows, e)
  assert balanced.sum() == rows and balanced.max() - balanced.min() <= 1
  random = em.routed_groups(rows, e, "random")
  assert random.dtype == np.int32 and random.shape == (e,) and random.sum() == rows
  np.testing.assert_array_equal(random, em.routed_groups(rows, e, "random"))  # fixed seed
  if rows >= e:  # uneven: some expert gets more than the balanced share
    assert random.max() > balanced.max()
  other = em.routed_groups(rows, e, "random", seed=3)
  assert other.sum() == rows and not np.array_equal(other, random)  # another draw
  np.testing.assert_array_equal(other, em.routed_groups(rows, e, "random", seed=3))


def test_routed_groups_rejects_unknown_routing():
  with pytest.raises(ValueError, match="routing"):
    em.routed_groups(8, 4, "zipf")
