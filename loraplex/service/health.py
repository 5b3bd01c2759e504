"""What `/v1/healthz` reports: the gateway itself, Redis (a PING), the database (a trivial query) and each pool of the
`pools` table (service/pool_health.py). Healthy = Redis, the database and this gateway's pool (settings.pool) up."""

from __future__ import annotations

from typing import Any

import redis as redis_lib
from sqlalchemy.exc import SQLAlchemyError

from loraplex import __version__
from loraplex.service.context import Services, fleet
from loraplex.service.pool_health import PoolHealth, all_pools, short_error
from loraplex.storage.db import ping as db_ping


def health_report(services: Services) -> tuple[bool, dict[str, Any]]:
    """(healthy, body): healthy when Redis, the database and this gateway's pool are up and ready."""
    down: list[str] = []
    redis_check: dict[str, Any] = {"ok": True}
    try:
        services.redis.ping()
    except redis_lib.RedisError as exc:
        redis_check = {"ok": False, "error": short_error(exc)}
        down.append(f"redis: {short_error(exc)}")
    db_check: dict[str, Any] = {"ok": True}
    pools: list[PoolHealth] = []
    try:
        with services.sessions() as session:
            db_ping(session)
        pools = all_pools(services.settings, services.sessions)
    except SQLAlchemyError as exc:
        db_check = {"ok": False, "error": short_error(exc)}
        down.append(f"database: {short_error(exc)}")
    mine = next((p for p in pools if p.name == services.settings.pool), None)
    if mine is not None and not mine.ok:
        down.append(mine.reason)
    healthy = not down
    body = {
        "status": "ok" if healthy else "unavailable",
        "down": down,
        "base_model": services.settings.base_model,
        "pool": services.settings.pool,
        # Every served base model and its pools (service/fleet.py): the live pools' registrations.
        "served_models": {m.name: list(m.pool_names) for m in fleet(services).models.values()},
        "gateway": {"ok": True, "version": __version__},
        "redis": redis_check,
        "database": db_check,
        "pools": [p.as_dict() for p in pools],
    }
    return healthy, body
