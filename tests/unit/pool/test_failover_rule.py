"""The failover rule (pool/failover_rule.py): which sibling pools a pool may fail over now."""

from __future__ import annotations

from loraplex.pool.failover import sweep_interval
from loraplex.pool.failover_rule import dead_siblings, seen_dead_long_enough

NOW = 1_000.0
MODELS = {"me": "tiny", "a": "tiny", "b": "tiny", "c": "tiny", "moe": "tiny-moe"}


def _dead(
    last_seen: dict[str, float], live: frozenset[str] = frozenset(), leased: frozenset[str] = frozenset()
) -> list[str]:
    return dead_siblings("me", "tiny", last_seen, MODELS, live, leased, NOW, after_s=30)


def test_a_sibling_gone_past_the_failover_time_is_dead_and_only_then() -> None:
    assert _dead({"me": NOW, "a": NOW - 30, "b": NOW - 29.9}) == ["a"]
    assert _dead({"me": NOW, "b": NOW - 300, "a": NOW - 31}) == ["a", "b"]  # sorted


def test_a_pool_with_a_live_registration_or_lease_is_not_dead() -> None:
    old = {"a": NOW - 300, "b": NOW - 300, "c": NOW - 300}
    assert _dead(old, live=frozenset({"a"}), leased=frozenset({"b"})) == ["c"]  # a standby that took b over leads it


def test_only_siblings_of_the_same_base_model_and_never_itself() -> None:
    assert _dead({"me": NOW - 300, "moe": NOW - 300, "gone": NOW - 300}) == []  # "gone": no SQL row, model unknown


def test_a_pool_that_never_recorded_when_it_was_seen_is_left_alone() -> None:
    assert _dead({"a": 0.0}) == []


def test_the_sweep_interval_follows_the_failover_time_within_bounds() -> None:
    assert sweep_interval(30) == 5.0 and sweep_interval(6) == 1.0 and sweep_interval(1) == 0.5


def test_a_candidate_counts_once_this_observer_saw_it_dead_for_the_wait_and_starts_over_when_seen_alive() -> None:
    dead, since = seen_dead_long_enough(["a", "b"], {}, now=100.0, wait_s=10)
    assert dead == [] and since == {"a": 100.0, "b": 100.0}  # first sightings (after a Redis outage: every pool)
    dead, since = seen_dead_long_enough(["a", "b"], since, now=109.0, wait_s=10)
    assert dead == []
    dead, since = seen_dead_long_enough(["a"], since, now=110.0, wait_s=10)  # b renewed its lease meanwhile
    assert dead == ["a"] and since == {"a": 100.0}
    dead, since = seen_dead_long_enough(["a", "b"], since, now=111.0, wait_s=10)
    assert dead == ["a"] and since == {"a": 100.0, "b": 111.0}  # b starts over
