"""Moving an adapter to another pool of its base model, the operator's call (`loraplex pool move`): checked here,
asked of the pool it is on (queue/handoff.order_move), done by that pool between two plans and adopted by the target
(pool/handoff.py). `wait_placed` waits until SQL places it on the target (its requests then go there)."""

from __future__ import annotations

import time

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.queue import handoff
from loraplex.service.context import Services, fleet
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
    handoff.order_move(services.redis, source, model_id, to_pool)
    return source


def wait_placed(services: Services, model_id: str, pool: str, timeout_s: float) -> bool:
    """Wait until the adapter is placed on `pool` in SQL (the hand-over is done); False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if placed_pool(services, model_id) == pool:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(WAIT_POLL_S)
