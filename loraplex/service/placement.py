"""Placement: which pool of its base model a new adapter goes to. Pure (no SQL, no Redis): the caller reads each
candidate pool's load and records the answer (adapters.pool).

The rule, in order:
1. most free resident slots: the pool's slots less the live adapters already placed on it (below zero once its
   adapters take turns in the slots: the pool with fewer turns to share wins);
2. fewest queued tokens (the registry's figure: work accepted and not yet answered);
3. the pool's name, so equal pools are chosen the same way by every gateway.
Placements counted as they are made, so tenants' adapters spread over the pools of a model one by one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolLoad:
    """One candidate pool: its resident slots, the live adapters placed on it, its queued tokens."""

    name: str
    slots: int
    placed: int = 0
    queued_tokens: int = 0

    @property
    def free_slots(self) -> int:
        return self.slots - self.placed


def placement_key(pool: PoolLoad) -> tuple[int, int, str]:
    """The rule as a sort key: the smallest key wins."""
    return (-pool.free_slots, pool.queued_tokens, pool.name)


def choose_pool(candidates: Sequence[PoolLoad]) -> str:
    """The name of the pool a new adapter goes to; ValueError for no candidates (the caller has refused the base model
    already: service/fleet.py)."""
    if not candidates:
        raise ValueError("no pool to place the adapter on")
    return min(candidates, key=placement_key).name
