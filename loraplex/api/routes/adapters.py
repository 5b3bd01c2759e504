"""Adapters: create, list, read, delete, and the training calls that return futures (rules: service/).

The training calls take no DbDep: the service checks the adapter in a short session of its own."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.routes.chain import seq_step
from loraplex.protocol import RequestKind
from loraplex.service.schemas import (
    AdapterOut,
    CreateAdapterRequest,
    ForwardBackwardRequest,
    FutureRef,
    OptimStepRequest,
)

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])


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
def forward_backward(
    model_id: str, body: ForwardBackwardRequest, tenant: TenantDep, services: ServicesDep
) -> FutureRef:
    return service.forward_backward(services, tenant, model_id, body.seq_id, body.payload())


@router.post("/{model_id}/forward", status_code=202)
@seq_step(RequestKind.FORWARD)
def forward(model_id: str, body: ForwardBackwardRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return service.forward(services, tenant, model_id, body.seq_id, body.payload())


@router.post("/{model_id}/optim_step", status_code=202)
@seq_step(RequestKind.OPTIM_STEP)
def optim_step(model_id: str, body: OptimStepRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return service.optim_step(services, tenant, model_id, body.seq_id, body.payload())
