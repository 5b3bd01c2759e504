"""Checkpoints of an adapter: save (state or sampler weights), load into the adapter, list, delete. The rules (names,
409 on an existing name, the folder in the blob store, tenant isolation) are service/checkpoints.py."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.routes.chain import seq_step
from loraplex.protocol import RequestKind
from loraplex.service.schemas import (
    CheckpointListOut,
    CheckpointOut,
    FutureRef,
    LoadStateRequest,
    SaveCheckpointRequest,
)

router = APIRouter(prefix="/v1/adapters", tags=["checkpoints"], route_class=JsonBodyRoute)


@router.post("/{model_id}/save_state", status_code=202)
@seq_step(RequestKind.SAVE_STATE)
def save_state(model_id: str, body: SaveCheckpointRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    """Weights + optimizer state. The future's result: {path: tinker://<model_id>/weights/<name>, size_bytes, ...}."""
    return service.save_state(services, tenant, model_id, body)


@router.post("/{model_id}/save_weights_for_sampler", status_code=202)
@seq_step(RequestKind.SAVE_SAMPLER)
def save_weights_for_sampler(
    model_id: str, body: SaveCheckpointRequest, tenant: TenantDep, services: ServicesDep
) -> FutureRef:
    """Weights only. The future's result: {path: tinker://<model_id>/sampler_weights/<name>, ...}."""
    return service.save_weights_for_sampler(services, tenant, model_id, body)


@router.post("/{model_id}/load_state", status_code=202)
@seq_step(RequestKind.LOAD_STATE)
def load_state(model_id: str, body: LoadStateRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    """Load a checkpoint of this tenant into this (existing) adapter; a rank or target mismatch fails the future."""
    return service.load_state(services, tenant, model_id, body)


@router.get("/{model_id}/checkpoints")
def list_checkpoints(model_id: str, tenant: TenantDep, services: ServicesDep) -> CheckpointListOut:
    """Checkpoints of an adapter of this tenant (also after the adapter was deleted), oldest first."""
    return CheckpointListOut(checkpoints=service.list_checkpoints(services, tenant, model_id))


@router.delete("/{model_id}/checkpoints/{kind}/{name}")
def delete_checkpoint(model_id: str, kind: str, name: str, tenant: TenantDep, services: ServicesDep) -> CheckpointOut:
    """Delete the row, then (once committed) the files. `kind`: weights | sampler_weights (or state | sampler)."""
    return service.delete_checkpoint(services, tenant, model_id, kind, name)
