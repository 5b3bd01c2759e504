"""The placement rule (service/placement.py): most free resident slots, then fewest queued tokens, then the name;
pure, no services."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplex.service.placement import PoolLoad, choose_pool, place_many, placement_key


def test_the_pool_with_most_free_slots_wins_whatever_its_queue() -> None:
    busy_but_roomy = PoolLoad("b", slots=8, placed=2, queued_tokens=10_000)
    idle_but_full = PoolLoad("a", slots=8, placed=7, queued_tokens=0)
    assert choose_pool([idle_but_full, busy_but_roomy]) == "b"


def test_over_full_pools_compare_by_how_far_over_they_are() -> None:
    assert choose_pool([PoolLoad("a", 4, placed=12), PoolLoad("b", 8, placed=14)]) == "b"  # -8 vs -6 free


def test_equal_free_slots_go_to_fewer_queued_tokens_then_to_the_name() -> None:
    assert choose_pool([PoolLoad("a", 4, 1, queued_tokens=50), PoolLoad("b", 4, 1, queued_tokens=5)]) == "b"
    assert choose_pool([PoolLoad("b", 4, 1, 5), PoolLoad("a", 4, 1, 5)]) == "a"


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError, match="no pool"):
        choose_pool([])


loads = st.builds(
    PoolLoad,
    name=st.text(alphabet="abcdefgh", min_size=1, max_size=3),
    slots=st.integers(1, 16),
    placed=st.integers(0, 40),
    queued_tokens=st.integers(0, 10**6),
)


@given(st.lists(loads, min_size=1, max_size=8, unique_by=lambda p: p.name))
def test_the_chosen_pool_is_never_beaten_and_the_order_of_candidates_does_not_matter(pools: list[PoolLoad]) -> None:
    chosen = choose_pool(pools)
    best = next(p for p in pools if p.name == chosen)
    for other in pools:
        assert other.free_slots <= best.free_slots
        if other.free_slots == best.free_slots:
            assert (other.queued_tokens, other.name) >= (best.queued_tokens, best.name)
    assert choose_pool(list(reversed(pools))) == chosen
    assert placement_key(best) == min(placement_key(p) for p in pools)


@given(st.lists(st.integers(1, 16), min_size=1, max_size=6), st.integers(1, 64))
def test_placing_one_by_one_spreads_adapters_evenly_over_equal_pools(slot_counts: list[int], adapters: int) -> None:
    """Counted as they are placed (as the creating transaction counts them), adapters fill every pool's free slots
    in turn: the free slots of any two pools never differ by more than one once all are placed, unless a pool's
    slots exceed every other's by more than what was placed."""
    pools = [PoolLoad(f"p{i}", slots) for i, slots in enumerate(slot_counts)]
    for _ in range(adapters):
        name = choose_pool(pools)
        pools = [PoolLoad(p.name, p.slots, p.placed + (p.name == name), p.queued_tokens) for p in pools]
    assert sum(p.placed for p in pools) == adapters
    free = [p.free_slots for p in pools]
    placed_somewhere = [p.free_slots for p in pools if p.placed]
    if placed_somewhere:
        # a pool that took an adapter had, before its last one, at least as many free slots as any other pool now
        assert min(placed_somewhere) + 1 >= max(free)


def test_equal_pools_take_adapters_in_turn() -> None:
    pools = [PoolLoad("tiny-a", 8), PoolLoad("tiny-b", 8)]
    chosen = []
    for _ in range(16):
        name = choose_pool(pools)
        chosen.append(name)
        pools = [PoolLoad(p.name, p.slots, p.placed + (p.name == name)) for p in pools]
    assert chosen == ["tiny-a", "tiny-b"] * 8


def test_a_drained_pool_takes_no_adapter_however_free() -> None:
    drained = PoolLoad("a", slots=8, placed=0, draining=True)
    assert choose_pool([drained, PoolLoad("b", slots=1, placed=5)]) == "b"
    with pytest.raises(ValueError, match="every one is draining"):
        choose_pool([drained])


def test_place_many_counts_each_adapter_before_the_next() -> None:
    pools = [PoolLoad("a", slots=2, placed=1), PoolLoad("b", slots=2, placed=0), PoolLoad("c", 9, 0, draining=True)]
    assert place_many(pools, 5) == ["b", "a", "b", "a", "b"]  # b has 2 free; then equal ones go by name
    assert place_many(pools, 0) == []
