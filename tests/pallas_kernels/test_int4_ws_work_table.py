"""The int4 WS kernel's work table: the Pallas kernel against its jnp reference, the reference against the
`row_tiles` construction it replaced, and the coverage of every output block (CPU, interpret mode)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_grouped_matmul_mgpu as mg
from pallas_kernels import int4_ws_work_table as wt


def _random_case(rng, experts=None):
  e = int(experts or rng.integers(1, 9))
  block_r, n_tiles, n_ctas = int(rng.choice([8, 16])), int(rng.integers(1, 4)), int(rng.integers(1, 7))
  sizes = rng.integers(0, 40, e) * (rng.random(e) < 0.7)
  m = max(int(sizes.sum()) + int(rng.integers(0, 20)) * int(rng.random() < 0.5), 1)
  return sizes, dict(m=m, m_loaded=max(m + (-m % 8), block_r + 8), block_r=block_r, n_tiles=n_tiles, n_experts=e,
                     n_ctas=n_ctas)


def _assert_awkward_cases_drawn(cases):
  """The random cases (each a fresh compile of the tables, ~0.5 s on CPU) hold every awkward case: empty experts
  beside full ones, rows past the groups, a single expert, M' beyond M rounded to 8 (a window longer than M),
  block_r 8 and 16, 1, 2 and 3 N tiles, and at least 5 CTA counts, one CTA among them."""
  seen = set()
  for sizes, kw in cases:
    seen |= {("block_r", kw["block_r"]), ("n_tiles", kw["n_tiles"]), ("n_ctas", kw["n_ctas"])}
    seen |= {name for name, hit in [("empty experts", len(sizes) > 1 and (sizes == 0).any() and sizes.any()),
                                    ("rows past the groups", kw["m"] > sizes.sum()), ("one expert", len(sizes) == 1),
                                    ("long window", kw["m_loaded"] > kw["m"] + (-kw["m"] % 8))] if hit}
  want = {"empty experts", "rows past the groups", "one expert", "long window", ("block_r", 8), ("block_r", 16),
          ("n_tiles", 1), ("n_tiles", 2), ("n_tiles", 3), ("n_ctas", 1)}
  assert want <= seen and len({x for x in seen if x[0] == "n_ctas"}) >= 5, sorted(map(str, want - seen))


@pytest.mark.parametrize("experts,prefix,block,aligned", [
    (1, "masked", 64, False), (3, "scan", 16, True), (8, "masked", 64, True), (8, "scan", 16, False),
    (64, "masked", 64, False), (64, "scan", 32, True), (130, "masked", 32, False), (130, "scan", 16, True)])
def test_kernel_matches_reference(experts, prefix, block, aligned):
  """The whole table, zero rows included, equals the reference (3 random group-size sets per case), with the prefix
  sums as masked sums or scans, several rows per program, padded and aligned tiles (130 experts: Ep = 256)."""
  rng = np.random.default_rng(experts)
  for _ in range(3):
    sizes, kw = _random_case(rng, experts)
    kw["m_loaded"] = max(kw["m_loaded"], wt.window(kw["block_r"], aligned))
    want = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw, aligned=aligned))
    got = np.asarray(wt.work_table(jnp.asarray(sizes, jnp.int32), **kw, interpret=True, prefix=prefix, block=block,
                                   aligned=aligned))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sizes,m", [([3, -2, 4, 1], 8), ([20, 20, 0, 0], 24), ([-5, 30, 1, 2], 16)])
def test_negative_sizes_and_sizes_past_m_are_cut(sizes, m):
  """The table of sizes with a negative entry or summing past M is the table of the sizes cut at 0 and at M, in
  the kernel (scan and masked prefix) as in the reference; every row is stored once."""
  cut = np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0))]), m))
  kw = dict(m=m, m_loaded=max(m + (-m % 8), 16), block_r=8, n_tiles=2, n_experts=4, n_ctas=3)
  want = np.asarray(wt.work_table_reference(jnp.asarray(cut, jnp.int32), **kw))
  np.testing.assert_array_equal(np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw)), want)
  for prefix in wt.PREFIXES:
    got = wt.work_table(jnp.asarray(sizes, jnp.int32), **kw, interpret=True, prefix=prefix, block=16)
    np.testing.assert_array_equal(np.asarray(got), want)
  _check_coverage(want, list(cut), m, kw["m_loaded"], 8, 2, False)


def test_kernel_rejects_bad_arguments():
  with pytest.raises(ValueError, match="group_sizes"):
    wt.work_table(jnp.zeros((4,), jnp.int32), 8, 16, block_r=8, n_tiles=1, n_experts=5, n_ctas=2, interpret=True)
  with pytest.raises(ValueError, match="m_loaded"):
    wt.work_table(jnp.zeros((4,), jnp.int32), 8, 8, block_r=8, n_tiles=1, n_experts=4, n_ctas=2, interpret=True)
  with pytest.raises(ValueError, match="prefix"):
    wt.work_table(jnp.zeros((4,), jnp.int32), 8, 16, block_r=8, n_tiles=1, n_experts=4, n_ctas=2, prefix="tree")
  with pytest.raises(ValueError, match="block"):
    wt.work_table(jnp.zeros((4,), jnp.int32), 8, 16, block_r=8, n_tiles=1, n_experts=4, n_ctas=2, block=24)


def _work_table_from_row_tiles(group_sizes, m, m_loaded, *, block_r, n_tiles, n_experts, n_ctas):
  """The work table built directly from `row_tiles` (the kernel's first form: a search and a gather per item)."""
  tiles = np.asarray(mg.row_tiles(jnp.asarray(group_sizes, jnp.int32), m, block_r, m_loaded))
  n_items = (tiles[:, 2] > 0).sum() * n_tiles
  w = np.arange(n_ctas)[:, None] + np.arange(-(-tiles.shape[0] * n_tiles // n_ctas))[None, :] * n_ctas
  tile = tiles[np.minimum(w // n_tiles, tiles.shape[0] - 1)]
  cols = [np.minimum(tile[..., 0], n_experts - 1), w % n_tiles, tile[..., 3], tile[..., 1], tile[..., 2],
          tile[..., 0] >= n_experts, np.broadcast_to((np.maximum(n_items - np.arange(n_ctas) + n_ctas - 1, 0) //
                                                      n_ctas)[:, None], w.shape)]
  return np.stack(cols, axis=-1).astype(np.int32)


def test_reference_matches_row_tiles():
  """The masked-sum table equals the one built from `row_tiles` on every row a CTA reads, over random group
  sizes (empty experts, rows past the groups, block_r 8 / 16, several N tiles and CTA counts)."""
  rng = np.random.default_rng(0)
  cases = [_random_case(rng) for _ in range(20)]
  _assert_awkward_cases_drawn(cases)
  for sizes, kw in cases:
    want = _work_table_from_row_tiles(sizes, **kw)
    got = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw))
    assert got.shape == (*want.shape[:2], 8)
    np.testing.assert_array_equal(got[..., 6], want[..., 6])
    for c in range(kw["n_ctas"]):
      np.testing.assert_array_equal(got[c, :want[c, 0, 6], :6], want[c, :want[c, 0, 6], :6])


def _check_coverage(table, sizes, m, m_loaded, block_r, n_tiles, aligned):
  """Every row of every N tile is stored by exactly one item, of its own expert, inside the item's window."""
  win = wt.window(block_r, aligned)
  owner = np.repeat(np.arange(len(sizes) + 1), list(sizes) + [m - sum(sizes)])  # virtual expert E past the groups
  seen = np.zeros((m, n_tiles), np.int32)
  counts = table[:, 0, 6]
  assert np.all(table[:, :, 6] == counts[:, None]) and counts.max() - counts.min() <= 1  # round-robin
  for cta in range(table.shape[0]):
    for expert, j, loaded, first, count, virtual in table[cta, :counts[cta], :6]:
      rows = np.arange(first, first + count)
      seen[rows, j] += 1
      assert count > 0 and np.all(owner[rows] == (len(sizes) if virtual else expert))
      assert 0 <= expert < len(sizes) and loaded % 8 == 0 and loaded <= first
      assert first + count <= loaded + win <= m_loaded
  np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sizes,m,n_tiles,n_ctas", [([3, 0, 17, 1], 23, 2, 3), ([1] * 6, 6, 3, 5)])
def test_reference_covers_each_output_block_once(sizes, m, n_tiles, n_ctas, aligned):
  block_r = 8
  m_loaded = max(m + (-m % 8), wt.window(block_r, aligned))
  table = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), m, m_loaded, block_r=block_r,
                                            n_tiles=n_tiles, n_experts=len(sizes), n_ctas=n_ctas, aligned=aligned))
  _check_coverage(table, sizes, m, m_loaded, block_r, n_tiles, aligned)


def test_aligned_tiles_cover_random_groups_with_fewer_window_rows():
  """Aligned tiles over random group sizes (empty experts, rows past the groups, R 8 / 16): every row once, inside
  an R-row window; at most one tile per expert more than padded tiles; and under balanced routing (1, 8 or 16 rows
  per expert) exactly as many tiles as padded."""
  rng = np.random.default_rng(1)
  cases = [_random_case(rng) for _ in range(21)]
  _assert_awkward_cases_drawn(cases)
  for sizes, kw in cases:
    kw["m_loaded"] = max(kw["m_loaded"], wt.window(kw["block_r"], True))
    table = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw, aligned=True))
    _check_coverage(table, sizes, kw["m"], kw["m_loaded"], kw["block_r"], kw["n_tiles"], True)
    padded = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw))
    n_items = lambda t: int(t[:, 0, 6].sum())
    assert n_items(padded) <= n_items(table) <= n_items(padded) + (len(sizes) + 1) * kw["n_tiles"]
  for r, rows in ((8, 8), (16, 16), (8, 1)):
    sizes = np.full(6, rows)
    kw = dict(m=6 * rows, m_loaded=max(6 * rows, 16), block_r=r, n_tiles=2, n_experts=6, n_ctas=3)
    aligned = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw, aligned=True))
    padded = np.asarray(wt.work_table_reference(jnp.asarray(sizes, jnp.int32), **kw))
    assert aligned[:, 0, 6].sum() == padded[:, 0, 6].sum() == 6 * 2  # one tile per expert, 2 N tiles
