"""map_budget: the count of memory mappings grows with each executable jax keeps, and `release_if_over` brings it
back down by clearing jax's caches (only when over its threshold)."""

import jax.numpy as jnp

import map_budget  # pylint: disable=import-error


def _compile_many(n: int) -> None:
  for i in range(1, n + 1):  # eager ops at new shapes: each compiles and keeps an executable
    (jnp.sin(jnp.ones((i, 5))) * 3 + 1).sum(0).block_until_ready()


def test_the_count_grows_with_compiled_programs_and_a_release_returns_it():
  map_budget.reset()
  map_budget.release_if_over(fraction=0.0, margin=0.0)  # start from empty caches
  start = map_budget.mapping_count()
  _compile_many(60)
  grown = map_budget.mapping_count()
  assert grown >= start + 100  # ~3 mappings per executable, 4 ops x 60 shapes
  assert map_budget.release_if_over(fraction=1.0) is None  # under the limit: nothing cleared
  before, after = map_budget.release_if_over(fraction=0.0, margin=0.0)
  assert before >= grown and after < start + (grown - start) / 4
  map_budget.reset()


def test_the_limit_is_read_from_the_kernel():
  assert 1000 <= map_budget.map_limit() <= 2**31


def test_a_clear_that_leaves_the_count_high_does_not_repeat_after_every_test(monkeypatch):
  """Hysteresis: when clearing leaves more than the threshold (mappings that are not jax's), the next clear waits
  until the count has grown by `margin` of the limit over what the last one left."""
  counts = iter([900, 700, 720, 790, 820, 600])  # mapping_count() at each call, in order
  cleared = []
  monkeypatch.setattr(map_budget, "map_limit", lambda: 1000)
  monkeypatch.setattr(map_budget, "mapping_count", lambda: next(counts))
  monkeypatch.setattr(map_budget.jax, "clear_caches", lambda: cleared.append(1))
  map_budget.reset()
  try:
    assert map_budget.release_if_over(0.5, 0.1) == (900, 700)  # over half: cleared, 700 left (still over half)
    assert map_budget.release_if_over(0.5, 0.1) is None  # 720: within 100 of what the clear left
    assert map_budget.release_if_over(0.5, 0.1) is None  # 790
    assert map_budget.release_if_over(0.5, 0.1) == (820, 600)  # 820 > 700 + 100: cleared again
    assert len(cleared) == 2
  finally:
    map_budget.reset()


def test_a_clear_that_leaves_the_count_near_the_limit_does_not_stop_clearing(monkeypatch):
  """The hysteresis bound stops at `cap` of the limit: after a clear that leaves 950 of 1000, 960 still clears."""
  counts = iter([990, 950, 960, 940])
  monkeypatch.setattr(map_budget, "map_limit", lambda: 1000)
  monkeypatch.setattr(map_budget, "mapping_count", lambda: next(counts))
  monkeypatch.setattr(map_budget.jax, "clear_caches", lambda: None)
  map_budget.reset()
  try:
    assert map_budget.release_if_over(0.5, 0.1) == (990, 950)
    assert map_budget.release_if_over(0.5, 0.1) == (960, 940)  # over 0.9 x 1000, though within 100 of 950
  finally:
    map_budget.reset()
