"""Offline fine-tuning pipelines: submit (a config and its dataset records; a sweep makes one pipeline per grid
point), list, read, cancel, a finished pipeline's PEFT export (a tar) and a finished sweep's report files; and how
many pipelines workers are alive. HTTP to service calls only: service/pipelines.py."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.routes.export import TAR_MEDIA_TYPE
from loraplex.service import pipelines as service
from loraplex.service.pipeline_config import SubmitPipelineRequest
from loraplex.service.schemas import PipelineList, PipelineOut, PipelineWorkers, SubmittedPipelines

router = APIRouter(tags=["pipelines"], route_class=JsonBodyRoute)


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Archive members carry no owner or mode of the workers' files."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


MEDIA_TYPES = {"report.md": "text/markdown", "report.csv": "text/csv", "eval_loss.svg": "image/svg+xml"}


@router.post("/v1/pipelines")
def submit_pipeline(request: SubmitPipelineRequest, tenant: TenantDep, services: ServicesDep) -> SubmittedPipelines:
    return service.submit_pipeline(services, tenant, request)


@router.get("/v1/pipelines")
def list_pipelines(
    tenant: TenantDep,
    services: ServicesDep,
    sweep_id: str | None = None,
    limit: int = Query(100, description="1 to 1000"),
    offset: int = Query(0, description=">= 0"),
) -> PipelineList:
    return service.list_pipelines(services, tenant, sweep_id, limit, offset)


@router.get("/v1/pipelines/workers")
def pipeline_workers(tenant: TenantDep, services: ServicesDep) -> PipelineWorkers:
    """How many pipelines workers are alive (no pipeline has an id of this name: ids are UUIDs)."""
    return service.pipeline_workers_alive(services)


@router.get("/v1/pipelines/{pipeline_id}")
def get_pipeline(pipeline_id: str, tenant: TenantDep, services: ServicesDep) -> PipelineOut:
    return service.get_pipeline(services, tenant, pipeline_id)


@router.post("/v1/pipelines/{pipeline_id}/cancel")
def cancel_pipeline(pipeline_id: str, tenant: TenantDep, services: ServicesDep) -> PipelineOut:
    return service.cancel_pipeline(services, tenant, pipeline_id)


@router.get("/v1/pipelines/{pipeline_id}/export", response_class=FileResponse)
def pipeline_export(pipeline_id: str, tenant: TenantDep, services: ServicesDep) -> FileResponse:
    """The pipeline's PEFT export (adapter_model.safetensors, adapter_config.json, the tokenizer) as a tar archive of
    plain files: what `export_path` in its answers names."""
    folder = service.export_folder(services, tenant, pipeline_id)
    work = Path(tempfile.mkdtemp(prefix="loraplex-pipeline-export-"))
    try:
        archive = work / "peft.tar"
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    tar.add(path, arcname=path.name, recursive=False, filter=_plain_member)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return FileResponse(archive, media_type=TAR_MEDIA_TYPE, filename=f"pipeline-{pipeline_id}-peft.tar",
                        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True))  # fmt: skip


@router.get("/v1/sweeps/{sweep_id}/report/{name}", response_class=FileResponse)
def sweep_report(sweep_id: str, name: str, tenant: TenantDep, services: ServicesDep) -> FileResponse:
    path = service.sweep_report_file(services, tenant, sweep_id, name)
    return FileResponse(path, media_type=MEDIA_TYPES[name], filename=name)
