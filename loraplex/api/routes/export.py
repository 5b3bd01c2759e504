"""PEFT export over HTTP: `GET /v1/adapters/{model_id}/export?checkpoint=...` answers a tar archive of the PEFT folder
(adapter_model.safetensors, adapter_config.json, the base model's tokenizer) of one of the tenant's checkpoints, the
latest sampler or state checkpoint by default. The folder is built by `loraplex.exporting` (the code `loraplex export`
runs) in a temporary directory, which is removed once the archive is sent.

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

from loraplex.api.deps import DbDep, ServicesDep, TenantDep
from loraplex.errors import InvalidRequestError
from loraplex.exporting import find_export_checkpoint, write_peft_folder
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories.checkpoints import tinker_path

router = APIRouter(prefix="/v1/adapters", tags=["export"])

TAR_MEDIA_TYPE = "application/x-tar"
CHECKPOINT_HEADER = "X-Loraplex-Checkpoint"  # the tinker path of the exported checkpoint


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Archive members carry no owner or odd modes of the gateway's files."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


@router.get("/{model_id}/export", response_class=FileResponse)
def export_peft(
    model_id: str, tenant: TenantDep, db: DbDep, services: ServicesDep, checkpoint: str | None = None
) -> FileResponse:
    """The PEFT folder of `checkpoint` (tinker://<model_id>/<weights|sampler_weights>/<name> or <kind>/<name>;
    default: the latest sampler or state checkpoint) as a tar archive of plain files (application/x-tar)."""
    settings = services.settings
    adapter, found = find_export_checkpoint(db, tenant.id, model_id, checkpoint)
    if adapter.base_model != settings.base_model:
        raise InvalidRequestError(
            f"adapter {model_id!r} was trained on {adapter.base_model!r}; this service has {settings.base_model!r}"
        )
    work = Path(tempfile.mkdtemp(prefix="loraplex-export-"))
    try:
        # torch is imported here, on the first export (write_peft_folder imports the workers' code lazily).
        folder = write_peft_folder(
            settings, found, work / "peft", base_model=settings.base_model, base_model_path=adapter.base_model
        )
        archive = work / "peft.tar"
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(folder.iterdir()):
                if path.is_file():
                    tar.add(path, arcname=path.name, recursive=False, filter=_plain_member)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return FileResponse(
        archive,
        media_type=TAR_MEDIA_TYPE,
        filename=f"{model_id.replace(':', '_')}-{found.name}.tar",
        headers={CHECKPOINT_HEADER: tinker_path(found.model_id, CheckpointKind(found.kind), found.name)},
        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True),
    )
