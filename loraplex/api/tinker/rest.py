"""Tinker REST routes (the SDK's RestClient, its CLI and the cookbook's checkpoint utilities): training runs, checkpoints
per run and across runs, delete (one, or many by tinker path), TTL, weights_info, and the PEFT archive of a
checkpoint (a tar: adapter_model.safetensors, adapter_config.json, the tokenizer). The same service calls as the
native `/v1/runs` and `/v1/checkpoints` routes; another tenant's run or checkpoint is the 404 of a missing one.

A checkpoint in a URL is `<weights|sampler_weights>/<name>` (Tinker's checkpoint_id, with its slash)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import FileResponse
from pydantic import Field

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.routes.export import peft_tar_response
from loraplex.api.tinker.schemas import Body, TtlBody, WeightsInfoBody
from loraplex.protocol.checkpoint_paths import parse_kind, tinker_path
from loraplex.service.paging import DEFAULT_PAGE_LIMIT, cursor
from loraplex.service.schemas import CheckpointOut, RunOut

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=JsonBodyRoute)

LIMIT = Query(DEFAULT_PAGE_LIMIT, description="Page size (1-1000)")
OFFSET = Query(0, description="Rows to skip")


class DeletePathsBody(Body):
    tinker_paths: list[str] = Field(..., max_length=1000)


def run_json(run: RunOut) -> dict[str, Any]:
    """Tinker's TrainingRun: its user_metadata is string to string."""
    out = run.model_dump(mode="json")
    out["user_metadata"] = {str(k): v if isinstance(v, str) else str(v) for k, v in run.user_metadata.items()} or None
    return out


def _path(training_run_id: str, kind: str, name: str) -> str:
    return tinker_path(training_run_id, parse_kind(kind), name)


@router.get("/training_runs")
def list_training_runs(
    tenant: TenantDep, services: ServicesDep, limit: int = LIMIT, offset: int = OFFSET
) -> dict[str, Any]:
    page = service.list_runs(services, tenant, limit, offset)
    return {"training_runs": [run_json(r) for r in page.training_runs], "cursor": page.cursor.model_dump()}


@router.get("/training_runs/{training_run_id}")
def get_training_run(training_run_id: str, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    return run_json(service.get_run(services, tenant, training_run_id))


@router.get("/training_runs/{training_run_id}/checkpoints")
def list_run_checkpoints(training_run_id: str, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    checkpoints = service.list_checkpoints(services, tenant, training_run_id)
    n = len(checkpoints)
    return {"checkpoints": [c.model_dump(mode="json") for c in checkpoints], "cursor": cursor(n, 0, n).model_dump()}


@router.delete("/training_runs/{training_run_id}/checkpoints/{kind}/{name}", status_code=204)
def delete_checkpoint(training_run_id: str, kind: str, name: str, tenant: TenantDep, services: ServicesDep) -> Response:
    service.delete_checkpoint(services, tenant, training_run_id, kind, name)
    return Response(status_code=204)


@router.put("/training_runs/{training_run_id}/checkpoints/{kind}/{name}/ttl")
def set_checkpoint_ttl(
    training_run_id: str, kind: str, name: str, body: TtlBody, tenant: TenantDep, services: ServicesDep
) -> CheckpointOut:
    return service.set_checkpoint_ttl(services, tenant, _path(training_run_id, kind, name), body.ttl_seconds)


@router.get("/training_runs/{training_run_id}/checkpoints/{kind}/{name}/archive", response_class=FileResponse)
def checkpoint_archive(
    training_run_id: str, kind: str, name: str, tenant: TenantDep, services: ServicesDep
) -> FileResponse:
    """The checkpoint's PEFT folder as a tar archive."""
    return peft_tar_response(services, tenant, training_run_id, _path(training_run_id, kind, name))


@router.get("/checkpoints")
def list_user_checkpoints(
    tenant: TenantDep, services: ServicesDep, limit: int = LIMIT, offset: int = OFFSET
) -> dict[str, Any]:
    page = service.list_all_checkpoints(services, tenant, limit, offset)
    return page.model_dump(mode="json")


@router.post("/checkpoints/delete")
def delete_checkpoints(body: DeletePathsBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """Delete many checkpoints by tinker path, all or none (a missing or foreign one: 404, nothing deleted)."""
    deleted = service.delete_checkpoints(services, tenant, body.tinker_paths)
    return {"deleted": [c.tinker_path for c in deleted]}


@router.post("/weights_info")
def weights_info(body: WeightsInfoBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    info = service.weights_info(services, tenant, body.tinker_path).model_dump(mode="json")
    return {**info, "optimizer_config": {"type": "adamw"}}
