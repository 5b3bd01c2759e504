"""GET /metrics: this gateway's request metrics (api/metrics.py). GET /metrics/pools: every pool's metrics as it last
published them to Redis (service/pool_metrics_reader.py). A separate path, so scraping N gateway replicas does not count each
pool N times: scrape /metrics on every replica and /metrics/pools on one (or each pool's own port). With
LORAPLEX_METRICS_TOKEN set, both answer `Authorization: Bearer <token>` only (401 otherwise). Without one, /metrics is
open (route templates and status codes: nothing of any tenant), and /metrics/pools, which names every tenant's
request kinds, tokens and queue depths (and `loraplex_tenant_info`, each tenant id's name), answers 403 unless LORAPLEX_METRICS_OPEN is true. Not in the OpenAPI schema:
it is Prometheus's text format, for scrapers, not a tenant's API."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.metrics import exposition, pool_health_exposition, tenant_info_exposition
from loraplex.errors import AuthenticationError, ForbiddenError
from loraplex.runtime.metrics_server import CONTENT_TYPE, token_ok
from loraplex.service.pool_health import all_pools
from loraplex.service.pool_metrics_reader import pool_exposition
from loraplex.service.tenant_overview import tenant_names

router = APIRouter(include_in_schema=False, route_class=JsonBodyRoute)


def _check_token(request: Request) -> None:
    if not token_ok(request.headers.get("authorization"), request.app.state.services.settings.metrics_token):
        raise AuthenticationError("the metrics need the metrics token: Authorization: Bearer <LORAPLEX_METRICS_TOKEN>")


def _check_tenant_metrics(request: Request) -> None:
    """The per-tenant series: the token when one is set, else only when the operator opened them."""
    settings = request.app.state.services.settings
    if settings.metrics_token:
        _check_token(request)
    elif not settings.metrics_open:
        raise ForbiddenError(
            "/metrics/pools names every tenant's usage: set LORAPLEX_METRICS_TOKEN (and scrape with "
            "Authorization: Bearer <token>), or LORAPLEX_METRICS_OPEN=true to serve it to anyone"
        )


@router.get("/metrics")
async def gateway_metrics(request: Request) -> Response:
    _check_token(request)
    services = request.app.state.services

    def body() -> bytes:
        try:  # the pools' health (pool names only) beside the gateway's own series; the database away: left out
            health = pool_health_exposition(all_pools(services.settings, services.sessions))
        except SQLAlchemyError:
            health = b""
        return exposition() + health

    return Response(await run_in_threadpool(body), media_type=CONTENT_TYPE)


@router.get("/metrics/pools")
async def pools_metrics(request: Request) -> Response:
    _check_tenant_metrics(request)
    services = request.app.state.services

    def body() -> bytes:
        try:  # the tenants' names for the pools' tenant ids; the database away: left out
            names = tenant_info_exposition(tenant_names(services))
        except SQLAlchemyError:
            names = b""
        return pool_exposition(services.redis) + names

    return Response(await run_in_threadpool(body), media_type=CONTENT_TYPE)
