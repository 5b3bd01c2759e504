"""A tenant's own request traces and per-session numbers (the Tinker console's per-session metrics): for one adapter
or one session, its requests' queue wait against compute, training utilization, tokens/s and what is in flight
(`/stats`), and the requests as Chrome/Perfetto trace-event JSON (`/trace`, a download). Another tenant's adapter or
session is a 404, as a missing one is. `since`: unix seconds, only requests answered from then on. Rules:
service/request_traces.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.service import request_traces

router = APIRouter(prefix="/v1", tags=["traces"], route_class=JsonBodyRoute)
# At most year 5138 (1e11 s): Redis stream ids are milliseconds in 64 bits, and no trace is older than its 7 days.
SINCE = Query(None, description="Unix seconds: only requests answered from then on", ge=0, le=1e11,
              allow_inf_nan=False)  # fmt: skip


def _download(body: dict[str, Any], name: str) -> JSONResponse:
    return JSONResponse(body, headers={"Content-Disposition": f'attachment; filename="{name}.trace.json"'})


@router.get("/adapters/{model_id}/trace")
def adapter_trace(model_id: str, tenant: TenantDep, services: ServicesDep, since: float | None = SINCE) -> JSONResponse:
    scope = request_traces.adapter_scope(services, tenant, model_id)
    return _download(request_traces.trace_export(services, scope, since), f"adapter-{model_id}")


@router.get("/adapters/{model_id}/stats")
def adapter_stats(
    model_id: str, tenant: TenantDep, services: ServicesDep, since: float | None = SINCE
) -> dict[str, Any]:
    scope = request_traces.adapter_scope(services, tenant, model_id)
    return request_traces.stats(services, scope, since).as_dict()


@router.get("/sessions/{session_id}/trace")
def session_trace(session_id: str, tenant: TenantDep, services: ServicesDep, since: float | None = SINCE
                  ) -> JSONResponse:  # fmt: skip
    scope = request_traces.session_scope(services, tenant, session_id)
    return _download(request_traces.trace_export(services, scope, since), f"session-{session_id}")


@router.get("/sessions/{session_id}/stats")
def session_stats(session_id: str, tenant: TenantDep, services: ServicesDep, since: float | None = SINCE
                  ) -> dict[str, Any]:  # fmt: skip
    scope = request_traces.session_scope(services, tenant, session_id)
    return request_traces.stats(services, scope, since).as_dict()
