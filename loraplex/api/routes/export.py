"""PEFT export over HTTP: `GET /v1/adapters/{model_id}/export?checkpoint=...` answers a tar archive of the PEFT folder
(adapter_model.safetensors, adapter_config.json, the base model's tokenizer) of one of the tenant's checkpoints, the
latest sampler or state checkpoint by default. The folder is built by the service layer (service/peft_export.py, the
export `loraplex export` runs too) in a temporary directory, removed once the archive is sent.

The checkpoint is read from the blob store with every file's sha256 verified: a tampered one is a 400 saying so.
Another tenant's adapter or checkpoint is a 404, the same as a missing one; an adapter with nothing saved is a 404
that says to save one first."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from loraplex import service
from loraplex.api.deps import Services, ServicesDep, TenantDep, TenantRef
from loraplex.api.json_body import JsonBodyRoute

router = APIRouter(prefix="/v1/adapters", tags=["export"], route_class=JsonBodyRoute)

TAR_MEDIA_TYPE = "application/x-tar"
CHECKPOINT_HEADER = "X-Loraplex-Checkpoint"  # the tinker path of the exported checkpoint


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Archive members carry no owner or odd modes of the gateway's files."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


@router.get("/{model_id}/export", response_class=FileResponse)
def export_peft(model_id: str, tenant: TenantDep, services: ServicesDep, checkpoint: str | None = None) -> FileResponse:
    """The PEFT folder of `checkpoint` (tinker://<model_id>/<weights|sampler_weights>/<name> or <kind>/<name>;
    default: the latest sampler or state checkpoint) as a tar archive of plain files (application/x-tar)."""
    return peft_tar_response(services, tenant, model_id, checkpoint)


def peft_tar_response(services: Services, tenant: TenantRef, model_id: str, checkpoint: str | None) -> FileResponse:
    """The PEFT folder of one of the tenant's checkpoints as a tar response (for any router): built in a temporary
    folder that is removed once the response is sent (or at once on an error, which is raised as it is: 404 for a
    missing or foreign adapter or checkpoint, 400 for a tampered one). `checkpoint`: a tinker path of `model_id`, or
    `<kind>/<name>`, or None for the latest sampler or state checkpoint. The X-Loraplex-Checkpoint header names the
    exported checkpoint's tinker path."""
    work = Path(tempfile.mkdtemp(prefix="loraplex-export-"))
    try:
        exported = service.export_peft(services, tenant, model_id, checkpoint, work / "peft")
        archive = work / "peft.tar"
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(exported.folder.iterdir()):
                if path.is_file():
                    tar.add(path, arcname=path.name, recursive=False, filter=_plain_member)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return FileResponse(
        archive,
        media_type=TAR_MEDIA_TYPE,
        filename=f"{model_id.replace(':', '_')}-{exported.name}.tar",
        headers={CHECKPOINT_HEADER: exported.tinker_path},
        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True),
    )
