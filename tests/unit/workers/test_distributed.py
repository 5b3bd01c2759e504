"""The pure parts of the multi-rank engine: how rows are split across ranks, and where a rank learns its place.
(The multi-process behaviour is in tests/integration/test_distributed*.py.)"""

from __future__ import annotations

import random

import pytest

from loraplex.settings import Settings
from loraplex.workers.engine.batching import SeqRef, split_microbatches
from loraplex.workers.ranks.distributed import split_rows, torchrun_env


def seqs(lengths: list[int]) -> list[SeqRef]:
    return [SeqRef(i // 2, i % 2, n) for i, n in enumerate(lengths)]


def test_split_keeps_order_and_contiguity_and_covers_every_row() -> None:
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(0, 12))]
        world = rng.randint(1, 5)
        parts = split_rows(seqs(lengths), world)
        assert len(parts) == world
        assert [s for part in parts for s in part] == seqs(lengths)  # contiguous ranges, in order


def test_split_balances_tokens() -> None:
    parts = split_rows(seqs([100, 1, 1, 1]), 2)
    assert [[s.length for s in p] for p in parts] == [[100], [1, 1, 1]]
    parts = split_rows(seqs([10] * 9), 2)  # odd count: one rank gets one more
    assert sorted(len(p) for p in parts) == [4, 5]
    parts = split_rows(seqs([5, 7, 30, 2, 2, 9, 40, 3]), 3)
    loads = [sum(s.length for s in p) for p in parts]
    assert max(loads) - min(loads) <= 40  # within one sequence of even


def test_split_with_fewer_sequences_than_ranks_leaves_ranks_empty() -> None:
    parts = split_rows(seqs([11]), 4)
    assert sum(len(p) for p in parts) == 1 and sum(1 for p in parts if not p) == 3
    assert split_rows([], 3) == [[], [], []]


def test_one_rank_gets_everything_and_microbatches_as_before() -> None:
    all_seqs = seqs([7, 31, 5, 60, 9])
    (only,) = split_rows(all_seqs, 1)
    assert only == all_seqs
    assert split_microbatches(only, 96) == split_microbatches(all_seqs, 96)


def test_adapter_contiguous_rows_stay_contiguous_per_rank() -> None:
    # Items 0,0,1,1,1,2: each rank's slice is still grouped by item (so by adapter).
    layout = [SeqRef(item, j, n) for j, (item, n) in enumerate([(0, 3), (0, 9), (1, 4), (1, 4), (1, 20), (2, 6)])]
    for world in (2, 3, 4):
        for part in split_rows(layout, world):
            items = [s.item for s in part]
            assert items == sorted(items)


def test_torchrun_env_and_the_world_size_setting() -> None:
    assert torchrun_env({}) is None
    env = torchrun_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "99"})
    assert env is not None and (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        3,
        4,
        1,
        "h",
        99,
    )
    assert Settings().world_size == 1
    with pytest.raises(ValueError):
        Settings(world_size=0)
