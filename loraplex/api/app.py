"""The gateway app. Stateless: any number of replicas can run against the same Redis and database."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from anyio import to_thread
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from loraplex import __version__
from loraplex.api import tinker
from loraplex.api.admission import BodyLimit
from loraplex.api.door import Door
from loraplex.api.errors import install_error_handlers
from loraplex.api.metrics import RequestMetrics, count_sql_statements
from loraplex.api.openai.routes import router as openai_router
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
    traces,
)
from loraplex.api.timeline import gateway_id, publish_forever
from loraplex.service import reap_idle_sessions
from loraplex.service.build import build_services
from loraplex.service.context import Services
from loraplex.settings import Settings, get_settings

log = logging.getLogger("loraplex.api")


async def _reap_sessions(services: Services) -> None:
    """Finish Tinker sessions that stopped beating, freeing their adapters (service/sessions.py), every
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
        reporter = asyncio.create_task(publish_forever(app.state.services.redis, gateway_id(settings.api_port)))
        yield
        reaper.cancel()
        reporter.cancel()
        app.state.services.redis.close()
        app.state.services.results.wait_redis.close()

    count_sql_statements()
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
    app.include_router(traces.router)
    app.include_router(openai_router)
    app.include_router(metrics.router)
    return app
