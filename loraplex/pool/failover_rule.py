"""Which pools are dead enough for a sibling to take their adapters (pool/failover.py). Pure: the caller reads the
registry, the leases and the pools' rows.

A pool is failed over by a sibling when all of these hold:
- it serves the sibling's base model (as its SQL row says: a dead pool's registration has lapsed) and is not the
  sibling itself;
- no live registration and no live lease: no process of it leads it, and none took it over (a standby would have);
- its leader last registered at least `after_s` ago (a pool that never recorded when is left alone: nothing says how
  long it has been gone).
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
