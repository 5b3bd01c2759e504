"""The gateway app. Stateless: any number of replicas can run against the same Redis and database."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from anyio import to_thread
from fastapi import FastAPI
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from starlette.concurrency import run_in_threadpool

from loraplex import __version__
from loraplex.api import tinker
from loraplex.api.admission import BodyLimit
from loraplex.api.auth_cache import AuthCache
from loraplex.api.deps import Services
from loraplex.api.door import Door
from loraplex.api.errors import install_error_handlers
from loraplex.api.long_polls import LongPollSlots, process_long_polls
from loraplex.api.metrics import RequestMetrics
from loraplex.api.openai.routes import router as openai_router
from loraplex.api.rate_limit import TenantRateLimit
from loraplex.api.routes import (
    adapters,
    checkpoints,
    export,
    futures,
    health,
    metrics,
    pipelines,
    runs,
    samplers,
    tenant_checkpoints,
)
from loraplex.api.service import reap_idle_sessions
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings, get_settings
from loraplex.storage.db import make_db_engine, session_factory

log = logging.getLogger("loraplex.api")


# Redis connections a gateway process uses beyond one per worker thread: code on the event loop (the session reaper's
# lock, a middleware's check) holds at most one at a time.
EVENT_LOOP_CONNECTIONS = 8


def _redis_client(settings: Settings, max_connections: int) -> redis.Redis:
    # Fail fast while Redis is down (one quick retry, which also replaces a connection a Redis restart broke): the
    # request gets a 503 with Retry-After at once instead of redis-py's default ~5 s of retries (api/errors.py).
    return redis.Redis.from_url(
        settings.redis_url,
        decode_responses=False,
        socket_connect_timeout=2.0,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
        max_connections=max_connections,
    )


def build_services(settings: Settings) -> Services:
    if not settings.redis_url:
        raise RuntimeError("LORAPLEX_REDIS_URL is not set (`loraplex serve --embedded` sets it for its children)")
    # Two connection pools, each sized so it never runs out (redis-py's default cap of 100 did, and every call then
    # failed with 503): the short calls' pool one connection per worker thread (a thread holds at most one at a
    # time), the long-polls' their own, as many as api/long_polls.py lets wait at once, so waits never take the
    # connections the short calls need.
    long_polls = process_long_polls(settings.max_long_polls, settings.gateway_threads)
    client = _redis_client(settings, settings.gateway_threads + EVENT_LOOP_CONNECTIONS)
    wait_client = _redis_client(settings, long_polls)
    db_engine = make_db_engine(settings.resolved_database_url)
    return Services(
        settings=settings,
        sessions=session_factory(db_engine),
        redis=client,
        producer=Producer(
            client,
            settings.pool,
            max_queued_requests=settings.max_queued_requests_per_tenant,
            max_queued_tokens=settings.max_queued_tokens_per_tenant,
        ),
        results=ResultStore(client, wait_redis=wait_client),
        auth=AuthCache(settings.auth_cache_seconds),
        rate_limit=TenantRateLimit(settings.tenant_requests_per_second, settings.tenant_request_burst),
        long_polls=LongPollSlots(settings.max_long_polls_per_tenant, long_polls),
    )


async def _reap_sessions(services: Services) -> None:
    """Finish Tinker sessions that stopped beating, freeing their adapters (api/service/sessions.py), every
    `session_reap_seconds`; one gateway a round does it (a Redis lock). A failed round is logged and retried."""
    while True:
        await asyncio.sleep(services.settings.session_reap_seconds)
        try:
            await run_in_threadpool(reap_idle_sessions, services)
        except Exception as exc:  # noqa: BLE001 - Redis or the database away: the next round tries again
            log.warning("session reaper: %s: %s", type(exc).__name__, exc)


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = services or build_services(settings)
        # Sync routes run on anyio's worker threads (40 by default). A long-poll (futures, retrieve_future) holds one
        # while it waits, so the Tinker SDK polling every outstanding future could starve the other routes.
        to_thread.current_default_thread_limiter().total_tokens = settings.gateway_threads
        reaper = asyncio.create_task(_reap_sessions(app.state.services))
        yield
        reaper.cancel()
        app.state.services.redis.close()
        app.state.services.results.wait_redis.close()

    app = FastAPI(title="loraplex", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        anonymous_limit=settings.max_anonymous_body_bytes,
        read_timeout_s=settings.body_read_timeout_seconds,
    )
    app.add_middleware(Door)  # outside the body limit: it decides which limit a request gets
    app.add_middleware(RequestMetrics)  # added last: outermost, so the door's 401s and the body limit's 413s count
    app.include_router(health.router)
    app.include_router(adapters.router)
    app.include_router(checkpoints.router)
    app.include_router(export.router)
    app.include_router(futures.router)
    app.include_router(tinker.router)
    app.include_router(runs.router)
    app.include_router(tenant_checkpoints.router)
    app.include_router(samplers.router)
    app.include_router(pipelines.router)
    app.include_router(openai_router)
    app.include_router(metrics.router)
    return app
