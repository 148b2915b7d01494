"""The layer split of the contract (k = total // N each, the last stage takes the remainder) and the roles."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pp_worker.worker.shard import Role, Shard, compute_layer_range


@pytest.mark.parametrize(("stage", "num_stages", "total", "expected"), [
    (0, 2, 16, (0, 8)),
    (1, 2, 16, (8, 16)),
    (0, 3, 16, (0, 5)),
    (1, 3, 16, (5, 10)),
    (2, 3, 16, (10, 16)),  # remainder 1 goes to the last stage
    (0, 4, 22, (0, 5)),
    (3, 4, 22, (15, 22)),  # remainder 2 goes to the last stage
    (0, 2, 2, (0, 1)),
    (1, 2, 3, (1, 3)),
    (4, 5, 5, (4, 5)),  # one block each
    (6, 7, 32, (24, 32)),
])
def test_compute_layer_range_table(stage: int, num_stages: int, total: int, expected: tuple[int, int]) -> None:
    assert compute_layer_range(stage, num_stages, total) == expected


@pytest.mark.parametrize(("stage", "num_stages", "total"), [
    (0, 1, 16),  # a pipeline needs two stages
    (0, 0, 16),
    (0, -2, 16),
    (2, 2, 16),  # stage out of range
    (-1, 2, 16),
    (5, 3, 16),
    (0, 5, 4),  # more stages than blocks
    (0, 2, 1),
    (0, 2, 0),
])
def test_compute_layer_range_rejects_impossible_splits(stage: int, num_stages: int, total: int) -> None:
    with pytest.raises(ValueError):
        compute_layer_range(stage, num_stages, total)


@given(num_stages=st.integers(2, 40), extra=st.integers(0, 200))
def test_ranges_tile_all_blocks_contiguously(num_stages: int, extra: int) -> None:
    total = num_stages + extra
    k = total // num_stages
    ranges = [compute_layer_range(s, num_stages, total) for s in range(num_stages)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in pairwise(ranges))  # contiguous, no overlap
    assert all(end - start == k for start, end in ranges[:-1])
    assert ranges[-1][1] - ranges[-1][0] == k + total % num_stages


@pytest.mark.parametrize(("stage", "num_stages", "role"), [
    (0, 2, Role.FIRST),
    (1, 2, Role.LAST),
    (0, 3, Role.FIRST),
    (1, 3, Role.MIDDLE),
    (2, 3, Role.LAST),
    (2, 5, Role.MIDDLE),
    (4, 5, Role.LAST),
])
def test_shard_role(stage: int, num_stages: int, role: Role) -> None:
    shard = Shard.of(stage, num_stages, 16)
    assert shard.role is role
    assert shard.is_first == (role is Role.FIRST)
    assert shard.is_last == (role is Role.LAST)


def test_shard_is_frozen_and_keeps_absolute_indices() -> None:
    shard = Shard.of(2, 3, 16)
    assert (shard.stage, shard.num_stages, shard.start, shard.end, shard.total_blocks) == (2, 3, 10, 16, 16)
    with pytest.raises(AttributeError):
        shard.start = 0  # type: ignore[misc]


def test_shard_of_rejects_bad_split() -> None:
    with pytest.raises(ValueError):
        Shard.of(0, 1, 16)
