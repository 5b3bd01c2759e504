"""A session's or an adapter's request traces and numbers, for its tenant (the API: only its own adapters, samplers
and sessions; anything else is a NotFoundError, the same as a missing one) and for operators (the admin: tenant None).

Where each time comes from (queue/request_traces.py): enqueue is the stream entry's id (Redis's clock at the
gateway's XADD), read/start/end are the dispatcher's and the engine's (the pool's clock), done is when the pool stored
the result. A session's requests are those of its adapters (training) and of its samplers (sampling); what is queued
or running now is read from the tenant's streams (in flight: no trace yet)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import orjson
from sqlalchemy import select

from loraplex.errors import NotFoundError
from loraplex.queue import keys, request_traces
from loraplex.queue.redis_text import text
from loraplex.queue.request_traces import TraceRecord
from loraplex.service.context import Services, TenantRef
from loraplex.service.request_stats import RequestStats, request_stats
from loraplex.service.trace_events import to_trace_events
from loraplex.storage.models import Adapter, SamplingSession, Tenant, TrainingSession

IN_FLIGHT_SCAN = 1000  # entries of a tenant's stream read at most per pool to count what is in flight


@dataclass(frozen=True)
class TraceScope:
    """What one export covers: the tenant and the model ids (adapters, samplers) whose requests it holds."""

    tenant_id: str
    tenant_name: str
    model_ids: tuple[str, ...]
    label: str  # "adapter <id>" or "session <id>"
    session_id: str | None = None  # an adapter's Tinker session, where it has one


def adapter_scope(services: Services, tenant: TenantRef | None, model_id: str) -> TraceScope:
    with services.sessions() as db:
        stmt = select(Adapter.tenant_id, Tenant.name, Adapter.session_id).join(Tenant, Tenant.id == Adapter.tenant_id)
        stmt = stmt.where(Adapter.model_id == model_id)
        if tenant is not None:
            stmt = stmt.where(Adapter.tenant_id == tenant.id)
        row = db.execute(stmt).first()
    if row is None:
        raise NotFoundError(f"adapter {model_id!r} not found")
    return TraceScope(row[0], row[1], (model_id,), f"adapter {model_id}", row[2])


def session_scope(services: Services, tenant: TenantRef | None, session_id: str) -> TraceScope:
    with services.sessions() as db:
        stmt = select(TrainingSession.tenant_id, Tenant.name).join(Tenant, Tenant.id == TrainingSession.tenant_id)
        stmt = stmt.where(TrainingSession.id == session_id)
        if tenant is not None:
            stmt = stmt.where(TrainingSession.tenant_id == tenant.id)
        row = db.execute(stmt).first()
        if row is None:
            raise NotFoundError(f"session {session_id!r} not found")
        tenant_id = row[0]
        adapters = db.scalars(select(Adapter.model_id).where(Adapter.session_id == session_id,
                                                             Adapter.tenant_id == tenant_id)).all()  # fmt: skip
        samplers = db.scalars(select(SamplingSession.id).where(SamplingSession.session_id == session_id,
                                                               SamplingSession.tenant_id == tenant_id)).all()  # fmt: skip
    return TraceScope(tenant_id, row[1], (*adapters, *samplers), f"session {session_id}")


def records(services: Services, scope: TraceScope, since: float | None = None) -> list[TraceRecord]:
    found = request_traces.read(services.redis, scope.model_ids, since)
    return [r for r in found if r.tenant_id == scope.tenant_id]  # a trace names its tenant: never another's


def in_flight(services: Services, scope: TraceScope) -> tuple[int, int]:
    """(requests, sample requests) of the scope's model ids accepted and not answered, on every pool of the fleet."""
    redis = services.redis
    pools = {text(p) for p in cast(set, redis.smembers(keys.fleet_pools()))} | {services.settings.pool}
    wanted = set(scope.model_ids)
    requests = samples = 0
    for pool in sorted(pools):
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]],
                       redis.xrange(keys.request_stream(pool, scope.tenant_id), count=IN_FLIGHT_SCAN))  # fmt: skip
        for _, fields in entries:
            raw = fields.get(b"data")
            try:
                head = orjson.loads(raw) if raw is not None else {}
            except orjson.JSONDecodeError:
                continue
            if head.get("model_id") in wanted:
                requests += 1
                samples += head.get("kind") == "sample"
    return requests, samples


def stats(services: Services, scope: TraceScope, since: float | None = None) -> RequestStats:
    return request_stats(records(services, scope, since), in_flight(services, scope))


def trace_export(services: Services, scope: TraceScope, since: float | None = None) -> dict[str, Any]:
    """The scope's traced requests as trace-event JSON (service/trace_events.py)."""
    names = {m: f"{scope.tenant_name}/{m}" for m in scope.model_ids}
    out = to_trace_events(records(services, scope, since), names)
    out["otherData"]["scope"] = scope.label
    return out
