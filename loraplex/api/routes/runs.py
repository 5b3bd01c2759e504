"""Training runs (Tinker's TrainingRun view of an adapter): list, paged and newest first, and read one. Deleted
adapters stay listed, `status` "deleted". Rules: service/runs.py."""

from __future__ import annotations

from fastapi import APIRouter, Query

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.service.paging import DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT
from loraplex.service.schemas import RunOut, RunPage

router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=JsonBodyRoute)

# The bounds are the service's (a 400 naming them), so every front end shares one rule.
LIMIT = Query(DEFAULT_PAGE_LIMIT, description=f"Runs per page, 1 to {MAX_PAGE_LIMIT}")
OFFSET = Query(0, description="Runs to skip, >= 0")


@router.get("")
def list_runs(tenant: TenantDep, services: ServicesDep, limit: int = LIMIT, offset: int = OFFSET) -> RunPage:
    return service.list_runs(services, tenant, limit, offset)


@router.get("/{model_id}")
def get_run(model_id: str, tenant: TenantDep, services: ServicesDep) -> RunOut:
    return service.get_run(services, tenant, model_id)
