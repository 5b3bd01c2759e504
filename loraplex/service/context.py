"""What every service call is given: the gateway's shared services and the authenticated tenant. Built once in the
app's lifespan (api/app.py); the FastAPI dependencies in api/deps.py hand them to the routes."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.service.auth_cache import AuthCache
from loraplex.service.fleet import Fleet
from loraplex.service.fleet_view import FleetView
from loraplex.service.long_polls import LongPollSlots
from loraplex.service.pool_health import PoolView
from loraplex.service.rate_limit import TenantRateLimit
from loraplex.settings import Settings
from loraplex.storage.blobs import BlobStore
from loraplex.storage.enums import TenantState
from loraplex.storage.repositories import unit_of_work


@dataclass(frozen=True)
class TenantQuotas:
    """A tenant's own quotas, set by an operator: None reads the setting's, 0 means no limit (as the settings do)."""

    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    max_adapters: int | None = None


@dataclass(frozen=True)
class TenantRef:
    """The authenticated tenant, as the gateway read it (its auth cache keeps it up to `auth_cache_seconds`)."""

    id: str
    name: str
    state: TenantState = TenantState.ACTIVE
    state_reason: str | None = None
    quotas: TenantQuotas = TenantQuotas()


@dataclass
class Services:
    """Everything a route needs, built once in the app's lifespan."""

    settings: Settings
    sessions: sessionmaker[Session]
    redis: redis.Redis
    producer: Producer
    results: ResultStore
    auth: AuthCache[TenantRef] = field(default_factory=lambda: AuthCache(0.0))
    # This gateway's pool's health, re-read at most once a second (service/pool_health.py).
    pool_view: PoolView = field(default_factory=PoolView)
    # The live pools and the base models they serve, re-read at most once a second (service/fleet_view.py).
    fleet_view: FleetView = field(default_factory=FleetView)
    # Each tenant's request rate on this process (service/rate_limit.py); off unless built with a rate.
    rate_limit: TenantRateLimit = field(default_factory=lambda: TenantRateLimit(0.0, 1))
    # Each tenant's long-polls waiting on this process (service/long_polls.py); unbounded unless built with limits.
    long_polls: LongPollSlots = field(default_factory=lambda: LongPollSlots(2**31, 2**31))


def write_session(services: Services) -> AbstractContextManager[Session]:
    """One transaction: committed when the block ends, rolled back (nothing half-written) on any error. On SQLite it
    takes the write lock up front, so a concurrent writer makes it wait rather than fail."""
    return unit_of_work(services.sessions)


def db_engine(services: Services) -> Engine:
    """The engine the sessions are bound to: a one-row read needs no session (storage/db.py, `single_read`)."""
    engine: Engine = services.sessions.kw["bind"]
    return engine


def fleet(services: Services) -> Fleet:
    """The served base models and their pools now (at most a second old)."""
    return services.fleet_view.get(services.settings, services.redis)


def blob_store(services: Services) -> BlobStore:
    return BlobStore(services.settings.resolved_blob_root)
