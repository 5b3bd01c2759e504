"""Liveness: the gateway answers, Redis answers."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex.api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/v1/healthz")
def healthz(services: ServicesDep) -> dict[str, object]:
    services.redis.ping()
    return {"status": "ok", "base_model": services.settings.base_model, "pool": services.settings.pool}
