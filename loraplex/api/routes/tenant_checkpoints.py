"""The tenant's checkpoints across its adapters, by tinker path: list (paged, newest first), bulk delete (all or
none), time to live, weights_info. Rules: service/checkpoints.py. (Per-adapter saves, loads, listing and delete:
routes/checkpoints.py.)"""

from __future__ import annotations

from fastapi import APIRouter, Query

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.service.paging import DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT
from loraplex.service.schemas import (
    CheckpointListOut,
    CheckpointOut,
    CheckpointPage,
    CheckpointTtlRequest,
    DeleteCheckpointsRequest,
    WeightsInfoOut,
    WeightsInfoRequest,
)

router = APIRouter(prefix="/v1", tags=["checkpoints"], route_class=JsonBodyRoute)

LIMIT = Query(DEFAULT_PAGE_LIMIT, description=f"Checkpoints per page, 1 to {MAX_PAGE_LIMIT}")
OFFSET = Query(0, description="Checkpoints to skip, >= 0")


@router.get("/checkpoints")
def list_all_checkpoints(
    tenant: TenantDep, services: ServicesDep, limit: int = LIMIT, offset: int = OFFSET
) -> CheckpointPage:
    """Every checkpoint of the tenant (deleted adapters' too), newest first."""
    return service.list_all_checkpoints(services, tenant, limit, offset)


@router.post("/checkpoints/delete")
def delete_checkpoints(body: DeleteCheckpointsRequest, tenant: TenantDep, services: ServicesDep) -> CheckpointListOut:
    """Delete every checkpoint named, or none (a missing or another tenant's path is a 404 naming it)."""
    return CheckpointListOut(checkpoints=service.delete_checkpoints(services, tenant, body.paths))


@router.put("/checkpoints/ttl")
def set_checkpoint_ttl(body: CheckpointTtlRequest, tenant: TenantDep, services: ServicesDep) -> CheckpointOut:
    """Expire the checkpoint ttl_seconds from now, or never (null)."""
    return service.set_checkpoint_ttl(services, tenant, body.path, body.ttl_seconds)


@router.post("/weights_info")
def weights_info(body: WeightsInfoRequest, tenant: TenantDep, services: ServicesDep) -> WeightsInfoOut:
    return service.weights_info(services, tenant, body.tinker_path)
