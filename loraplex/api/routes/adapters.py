"""Adapters: create, list, read, delete, and the training calls that return futures (rules: service/).

The training calls take no DbDep: the service checks the adapter on a connection of its own. They are async and hand
the service call to a worker thread themselves: a sync endpoint's answer would be validated in the threadpool too, a
second hop to a worker thread per request (FastAPI's serialize_response); this way it is validated on the event loop,
and the OpenAPI schema still documents the 202's FutureRef."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.routes.chain import seq_step
from loraplex.protocol import RequestKind
from loraplex.service.schemas import (
    AdapterOut,
    CreateAdapterRequest,
    ForwardBackwardRequest,
    FutureRef,
    OptimStepRequest,
)

router = APIRouter(prefix="/v1/adapters", tags=["adapters"], route_class=JsonBodyRoute)


@router.post("", status_code=202)
def create_adapter(body: CreateAdapterRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    """A new adapter from its seed, or (`from_checkpoint`) from one of the tenant's checkpoints."""
    return service.create_adapter(services, tenant, body)


@router.get("")
def list_adapters(tenant: TenantDep, services: ServicesDep) -> list[AdapterOut]:
    return service.list_adapters(services, tenant)


@router.get("/{model_id}")
def get_adapter(model_id: str, tenant: TenantDep, services: ServicesDep) -> AdapterOut:
    return service.get_adapter(services, tenant, model_id)


@router.delete("/{model_id}", status_code=202)
def delete_adapter(model_id: str, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return service.delete_adapter(services, tenant, model_id)


@router.post("/{model_id}/forward_backward", status_code=202)
@seq_step(RequestKind.FORWARD_BACKWARD)
async def forward_backward(
    model_id: str, body: ForwardBackwardRequest, tenant: TenantDep, services: ServicesDep
) -> FutureRef:
    return await run_in_threadpool(
        lambda: service.forward_backward(services, tenant, model_id, body.seq_id, body.payload())
    )


@router.post("/{model_id}/forward", status_code=202)
@seq_step(RequestKind.FORWARD)
async def forward(model_id: str, body: ForwardBackwardRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return await run_in_threadpool(lambda: service.forward(services, tenant, model_id, body.seq_id, body.payload()))


@router.post("/{model_id}/optim_step", status_code=202)
@seq_step(RequestKind.OPTIM_STEP)
async def optim_step(model_id: str, body: OptimStepRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return await run_in_threadpool(lambda: service.optim_step(services, tenant, model_id, body.seq_id, body.payload()))
