"""Which pools are dead enough for a sibling to take their adapters (pool/failover.py). Pure: the caller reads the
registry, the leases and the pools' rows.

A pool is failed over by a sibling when all of these hold:
- it serves the sibling's base model (as its SQL row says: a dead pool's registration has lapsed) and is not the
  sibling itself;
- no live registration and no live lease: no process of it leads it, and none took it over (a standby would have);
- its leader last registered at least `after_s` ago (a pool that never recorded when is left alone: nothing says how
  long it has been gone);
- and the sibling has seen it so for one lease TTL itself (`seen_dead_long_enough`): after a Redis outage every
  lease and registration has lapsed at once and every last registration is old, yet the live pools re-claim their
  leases within a third of the TTL once Redis answers; only a pool that did not is dead.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def dead_siblings(
    me: str,
    base_model: str,
    last_seen: Mapping[str, float],
    base_models: Mapping[str, str],
    live: Collection[str],
    leased: Collection[str],
    now: float,
    after_s: float,
) -> list[str]:
    """The names of the pools `me` may fail over now, sorted.
    last_seen: every registered pool -> when its leader last registered (0: unknown); base_models: pool -> its base
    model (SQL); live: pools with a live registration; leased: pools whose lease is held."""
    return sorted(
        name
        for name, seen in last_seen.items()
        if name != me
        and base_models.get(name) == base_model
        and name not in live
        and name not in leased
        and seen > 0
        and now - seen >= after_s
    )


def seen_dead_long_enough(
    candidates: Collection[str], dead_since: Mapping[str, float], now: float, wait_s: float
) -> tuple[list[str], dict[str, float]]:
    """Those of `candidates` this observer has seen dead for at least `wait_s` (dead_since: pool -> when it first saw
    it so, on its own clock), sorted; and the new dead_since: the candidates' first sightings, the others forgotten
    (a pool seen alive again starts over)."""
    since = {name: dead_since.get(name, now) for name in candidates}
    return sorted(name for name, first in since.items() if now - first >= wait_s), since
