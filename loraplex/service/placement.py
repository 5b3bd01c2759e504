"""Placement: which pool of its base model a new adapter goes to. Pure (no SQL, no Redis): the caller reads each
candidate pool's load and records the answer (adapters.pool).

The rule, in order:
1. most free resident slots: the pool's slots less the live adapters already placed on it (below zero once its
   adapters take turns in the slots: the pool with fewer turns to share wins);
2. fewest queued tokens (the registry's figure: work accepted and not yet answered);
3. the pool's name, so equal pools are chosen the same way by every gateway.
Placements counted as they are made, so tenants' adapters spread over the pools of a model one by one. A pool an
operator drained (`loraplex pool drain`) takes none."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PoolLoad:
    """One candidate pool: its resident slots, the live adapters placed on it, its queued tokens."""

    name: str
    slots: int
    placed: int = 0
    queued_tokens: int = 0
    draining: bool = False

    @property
    def free_slots(self) -> int:
        return self.slots - self.placed


def placement_key(pool: PoolLoad) -> tuple[int, int, str]:
    """The rule as a sort key: the smallest key wins."""
    return (-pool.free_slots, pool.queued_tokens, pool.name)


def choose_pool(candidates: Sequence[PoolLoad]) -> str:
    """The name of the pool a new adapter goes to; ValueError for no candidates (the caller has refused the base model
    already: service/fleet.py) or when every one is draining."""
    open_pools = [c for c in candidates if not c.draining]
    if not open_pools:
        raise ValueError("no pool to place the adapter on" + (" (every one is draining)" if candidates else ""))
    return min(open_pools, key=placement_key).name


def place_many(candidates: Sequence[PoolLoad], count: int) -> list[str]:
    """Where `count` adapters go, one by one, each counted on its pool before the next is placed (a drain's moves)."""
    loads = {c.name: c for c in candidates}
    out = []
    for _ in range(count):
        name = choose_pool(list(loads.values()))
        loads[name] = replace(loads[name], placed=loads[name].placed + 1)
        out.append(name)
    return out
