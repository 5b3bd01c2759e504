"""The health of the worker pools, from the `pools` table (heartbeat age and state, written by the pool process every
`pool_heartbeat_seconds`; repositories/pools.py). A pool is up when it has beaten within `pool_stale_seconds` and its
state is READY (it has loaded its base model and its dispatcher reads the stream)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.settings import Settings
from loraplex.storage.models import Pool, PoolState
from loraplex.storage.repositories import PoolRepository
from loraplex.storage.types import utcnow

# How long one gateway process reuses its view of its pool's health (the futures route asks on every pending answer).
POOL_VIEW_SECONDS = 1.0


@dataclass(frozen=True)
class PoolHealth:
    name: str
    ok: bool
    reason: str  # "" when ok; else why the pool cannot run requests now, for people ("no heartbeat for 40 s")
    state: str | None = None
    heartbeat_age_s: float | None = None
    base_model: str | None = None
    world_size: int | None = None
    slots: int | None = None

    @property
    def queue_state(self) -> str:
        """Tinker's `queue_state` for a request waiting on this pool: active, or paused_capacity while it is down."""
        return "active" if self.ok else "paused_capacity"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge_pool(name: str, row: Pool | None, stale_s: float, now: datetime) -> PoolHealth:
    if row is None:
        return PoolHealth(name, False, f"pool {name} paused: it has never sent a heartbeat (no worker started for it)")
    age = max(0.0, (now - row.heartbeat_at).total_seconds())
    if age > stale_s:
        loading = " while loading its base model" if row.state == PoolState.LOADING else ""
        reason = f"pool {name} paused: no heartbeat for {age:.0f} s{loading}"
    elif row.state == PoolState.LOADING:
        reason = f"pool {name} paused: loading its base model"
    elif row.state != PoolState.READY:
        reason = f"pool {name} paused: {row.state}"
    else:
        reason = ""
    return PoolHealth(name, not reason, reason, str(row.state), round(age, 1), row.base_model, row.world_size, row.slots)


def all_pools(settings: Settings, sessions: sessionmaker[Session]) -> list[PoolHealth]:
    """Every pool of the table, and this gateway's pool (settings.pool) even when it has no row."""
    stale_s, now = settings.pool_stale_seconds, utcnow()
    with sessions() as session:
        rows = {p.name: p for p in PoolRepository(session).list()}
        return [judge_pool(name, rows.get(name), stale_s, now) for name in sorted({*rows, settings.pool})]


class PoolView:
    """This gateway's pool's health, re-read at most every POOL_VIEW_SECONDS (per gateway process)."""

    def __init__(self, ttl_s: float = POOL_VIEW_SECONDS) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._value: tuple[float, PoolHealth] | None = None

    def get(self, settings: Settings, sessions: sessionmaker[Session]) -> PoolHealth:
        with self._lock:
            if self._value is not None and self._value[0] > time.monotonic():
                return self._value[1]
        name = settings.pool
        try:
            found = next(p for p in all_pools(settings, sessions) if p.name == name)
        except SQLAlchemyError as exc:
            found = PoolHealth(name, False, f"pool {name}: its state is unknown (database unavailable: {short_error(exc)})")
        with self._lock:
            self._value = (time.monotonic() + self.ttl_s, found)
        return found




def short_error(exc: BaseException) -> str:
    """An exception as one short line (SQLAlchemy's messages carry the statement and a link)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {first[:200]}"
