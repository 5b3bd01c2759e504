"""`/v1/healthz` for load balancers and people: 200 when this gateway, Redis, the database and this gateway's pool
(settings.pool: beating and READY, i.e. its base model is loaded) are up; 503 otherwise. The body names each part and
says which are down (`down`), with every pool's heartbeat age and state."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex.api.deps import ServicesDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.service.health import health_report

router = APIRouter(tags=["health"], route_class=JsonBodyRoute)


@router.get("/v1/healthz")
def healthz(services: ServicesDep) -> JSONResponse:
    healthy, body = health_report(services)
    return JSONResponse(status_code=200 if healthy else 503, content=body)
