"""The gateway's Prometheus metrics, every one defined here: requests per route template (never the raw path, so
ids do not multiply the series), method and status code, and their latencies; and the SQL statements the gateway
sends (storage/statement_count.py). `RequestMetrics` is the ASGI
middleware that counts them (outermost, so a 413 from the body limit counts too); the routes are
api/routes/metrics.py. Names: docs/architecture/metrics.md.

Several gateway processes of one `serve` (uvicorn --workers) share their counts through prometheus-client's
multiprocess mode: the composition root sets PROMETHEUS_MULTIPROC_DIR before the workers start
(`multiprocess_env`), and a scrape of any of them then answers the sum over all of them."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.api.timeline import TALLY
from loraplex.service.pool_health import PoolHealth
from loraplex.storage.statement_count import STATEMENTS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
UNMATCHED = "unmatched"  # the route label of a path no route has (its 404), so made-up paths add no series
# Long-polls (GET /v1/futures, Tinker's retrieve_future) wait up to 20-30 s: the buckets reach past that.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

REGISTRY = CollectorRegistry()
REQUESTS = Counter(
    "loraplex_gateway_requests",
    "HTTP requests answered, per route template, method and status code.",
    ("route", "method", "status"),
    registry=REGISTRY,
)
LATENCY = Histogram(
    "loraplex_gateway_request_seconds",
    "Seconds from a request's arrival to the end of its response, per route template and method.",
    ("route", "method"),
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SQL_STATEMENTS = Counter(
    "loraplex_gateway_sql_statements",
    "SQL statements this gateway sent to the database, per verb (select, insert, update, delete, begin, commit, "
    "rollback, other).",
    ("verb",),
    registry=REGISTRY,
)
_sql_counted = False


def count_sql_statements() -> None:
    """From now on, every statement this process sends counts in SQL_STATEMENTS (once per process, however many apps
    it builds)."""
    global _sql_counted
    if not _sql_counted:
        _sql_counted = True
        STATEMENTS.subscribe(lambda verb: SQL_STATEMENTS.labels(verb).inc())


def route_template(scope: Scope) -> str:
    """The path template of the route that answered (`/v1/adapters/{model_id}/forward_backward`), else the one the
    path matches (a response sent before routing, e.g. a 413 from the body limit), else UNMATCHED."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches(scope)
        if match != Match.NONE:
            return str(getattr(candidate, "path", UNMATCHED))
    return UNMATCHED


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the server answers when the app raises before it starts a response

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            method = scope.get("method", "")
            method = method if method in METHODS else "other"
            route = route_template(scope)
            seconds = time.perf_counter() - started
            REQUESTS.labels(route, method, str(status)).inc()
            LATENCY.labels(route, method).observe(seconds)
            TALLY.observe(route, status, seconds)


def exposition() -> bytes:
    """This gateway's metrics in text format: this process's, or every worker's of this `serve` (multiprocess)."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY)


class _PoolHealthFamilies:
    def __init__(self, pools: list[PoolHealth]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "loraplex_gateway_pool_up",
            "1 when the pool beat within pool_stale_seconds and is ready, else 0 (the pools table, as this gateway "
            "reads it).",
            labels=("pool",),
        )
        age = GaugeMetricFamily(
            "loraplex_gateway_pool_heartbeat_age_seconds", "Seconds since the pool's last heartbeat.", labels=("pool",)
        )
        for p in self.pools:
            up.add_metric((p.name,), 1.0 if p.ok else 0.0)
            if p.heartbeat_age_s is not None:
                age.add_metric((p.name,), p.heartbeat_age_s)
        yield up
        yield age


def pool_health_exposition(pools: list[PoolHealth]) -> bytes:
    """Every pool's health as gauges, read at the scrape (a dead pool publishes nothing itself: this says so)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PoolHealthFamilies(pools))
    return generate_latest(registry)


def tenant_info_exposition(tenants: list[tuple[str, str]]) -> bytes:
    """`loraplex_tenant_info{tenant, name} 1` per (id, name): the pools label their series with tenant ids, and a
    dashboard joins this on `tenant` to show names (`* on (tenant) group_left (name) loraplex_tenant_info`)."""
    family = GaugeMetricFamily("loraplex_tenant_info", "1 per tenant: its id (the pools' tenant label) and its name.",
                               labels=("tenant", "name"))  # fmt: skip
    for tenant_id, name in tenants:
        family.add_metric((tenant_id, name), 1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([family]))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self.families


def multiprocess_env(folder: Path, workers: int) -> dict[str, str]:
    """The environment for `workers` gateway processes of one server: with more than one, a fresh (emptied) folder
    for their shared counts; with one, nothing (each process counts for itself)."""
    if workers <= 1:
        return {}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return {MULTIPROC_ENV: str(folder)}
