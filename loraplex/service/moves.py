"""Moving adapters between the pools of a base model, the operator's calls: `move_adapter` (`loraplex pool move`)
checks and asks the pool the adapter is on (queue/handoff.order_move), which hands it over between two plans to the
target that adopts it (pool/handoff.py); `wait_placed` waits until SQL places it on the target (its requests then go
there). `drain_pool` (`loraplex pool drain`) marks a pool drained (placement gives it no new adapter) and moves each of
its adapters to a sibling pool of its base model by the placement rule, counting each as it is placed;
`undrain_pool` opens it again."""

from __future__ import annotations

import time

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.queue import handoff
from loraplex.service.adapters import pool_loads
from loraplex.service.context import Services, fleet, write_session
from loraplex.service.fleet import ServedModel
from loraplex.service.placement import place_many
from loraplex.storage.enums import AdapterStatus
from loraplex.storage.repositories import PoolRepository

WAIT_POLL_S = 0.1


def placed_pool(services: Services, model_id: str) -> str:
    """The pool a live adapter is placed on (one placed before the fleet: the gateway's own); NotFoundError otherwise."""
    with services.sessions() as db:
        row = PoolRepository(db).adapter(model_id)
        if row is None or row.status in (AdapterStatus.DELETED, AdapterStatus.FAILED):
            raise NotFoundError(f"adapter {model_id!r} not found")
        return row.pool or services.settings.pool


def move_adapter(services: Services, model_id: str, to_pool: str) -> str:
    """Ask the adapter's pool to hand it over to `to_pool`, a live pool of the same base model; returns the pool it is
    on now. NotFoundError: no such live adapter; InvalidRequestError: `to_pool` is not a live pool of its base model;
    ConflictError: it is on `to_pool` already."""
    with services.sessions() as db:
        row = PoolRepository(db).adapter(model_id)
        if row is None or row.status in (AdapterStatus.DELETED, AdapterStatus.FAILED):
            raise NotFoundError(f"adapter {model_id!r} not found")
        source, base_model = row.pool or services.settings.pool, row.base_model
    if source == to_pool:
        raise ConflictError(f"adapter {model_id} is on pool {to_pool} already")
    served = fleet(services).models.get(base_model)
    siblings = [p.name for p in served.pools if p.published_at] if served is not None else []
    if to_pool not in siblings:
        live = ", ".join(s for s in siblings if s != source) or "none"
        raise InvalidRequestError(
            f"pool {to_pool!r} is not a live pool of {base_model!r} (adapter {model_id}'s base model); live ones: {live}"
        )
    with services.sessions() as db:
        if PoolRepository(db).draining([to_pool]):
            raise InvalidRequestError(f"pool {to_pool!r} is drained: undrain it first (`loraplex pool undrain`)")
    handoff.order_move(services.redis, source, model_id, to_pool)
    return source


def drain_pool(services: Services, name: str) -> dict[str, str]:
    """Drain `name`: placement gives it no new adapter from now, and each live adapter on it is asked to move to a
    live sibling pool of its base model (not drained) by the placement rule; returns model_id -> the pool it goes to.
    NotFoundError: no such pool; InvalidRequestError: it has adapters and no sibling to take them (nothing changes)."""
    with services.sessions() as db:
        row = PoolRepository(db).find(name)
        if row is None:
            raise NotFoundError(f"pool {name!r} not found")
        base_model = row.base_model
    served = fleet(services).models.get(base_model)
    siblings = tuple(p for p in served.pools if p.published_at and p.name != name) if served is not None else ()
    with write_session(services) as db:
        pools = PoolRepository(db)
        pools.set_draining(name, True)
        adapters = pools.live_adapters_on(name, include_unplaced=name == services.settings.pool)
        if not adapters:
            return {}
        try:
            targets = place_many(pool_loads(db, ServedModel(base_model, siblings)), len(adapters)) if siblings else []
        except ValueError:
            targets = []
        if not targets:  # raising rolls the drain back: its adapters have nowhere to go
            live = ", ".join(p.name for p in siblings) or "none live"
            raise InvalidRequestError(f"pool {name!r} has {len(adapters)} adapters and no open sibling pool of "
                                      f"{base_model!r} to take them (siblings: {live}); nothing changed")  # fmt: skip
    moves = dict(zip(adapters, targets, strict=True))
    for model_id, target in moves.items():
        handoff.order_move(services.redis, name, model_id, target)
    return moves


def undrain_pool(services: Services, name: str) -> None:
    """Placement may give `name` new adapters again (NotFoundError: no such pool)."""
    with write_session(services) as db:
        PoolRepository(db).set_draining(name, False)


def wait_drained(services: Services, name: str, timeout_s: float) -> list[str]:
    """Wait until no live adapter is placed on `name`; those still there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with services.sessions() as db:
            left = PoolRepository(db).live_adapters_on(name, include_unplaced=name == services.settings.pool)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(WAIT_POLL_S)


def wait_placed(services: Services, model_id: str, pool: str, timeout_s: float) -> bool:
    """Wait until the adapter is placed on `pool` in SQL (the hand-over is done); False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if placed_pool(services, model_id) == pool:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(WAIT_POLL_S)
