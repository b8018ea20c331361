"""Tile and split-K choices of the shared ragged grouped-matmul skeleton."""

import pytest

from pallas_kernels import ragged_tiles


@pytest.mark.parametrize("m,e,smallest,want", [(1024, 64, 16, 16), (16, 8, 8, 8), (16, 8, 16, 16), (512, 8, 8, 64),
                                               (1, 128, 8, 8)])
def test_pick_block_m(m, e, smallest, want):
  assert ragged_tiles.pick_block_m(m, e, smallest=smallest) == want


@pytest.mark.parametrize("m,e,tiles,groups,want", [
    (1024, 64, 8, 32, 1),  # 512 programs: enough
    (16, 64, 8, 32, 2),  # at most 16 experts have rows: 128 programs -> 256
    (1, 64, 8, 32, 8),  # one expert: 8 programs, capped at 4 K groups per split
    (1, 8, 56, 32, 4),  # 56 programs -> 224
    (2, 128, 3, 16, 4),  # 6 programs, 16 groups -> 4 per split
])
def test_pick_split_k(m, e, tiles, groups, want):
  assert ragged_tiles.pick_split_k(m, e, tiles, groups) == want
