"""PEFT export of one of the tenant's checkpoints into a folder (`loraplex.exporting` builds it: torch is loaded there,
on the first export only, so the gateway itself stays free of it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import InvalidRequestError
from loraplex.exporting import find_export_checkpoint, write_peft_folder
from loraplex.protocol.checkpoint_paths import CheckpointKind, tinker_path
from loraplex.service.context import Services, TenantRef


@dataclass(frozen=True)
class PeftExport:
    folder: Path  # adapter_model.safetensors, adapter_config.json, the base model's tokenizer
    tinker_path: str  # of the exported checkpoint
    name: str  # of the exported checkpoint


def export_peft(services: Services, tenant: TenantRef, model_id: str, ref: str | None, out_dir: Path) -> PeftExport:
    """Write the PEFT folder of `ref` (a tinker path of this adapter or `<kind>/<name>`; default: the latest sampler
    or state checkpoint) into `out_dir`. 404 for another tenant's or a missing adapter or checkpoint, or nothing
    saved yet; 400 for an adapter of another base model or a tampered checkpoint."""
    settings = services.settings
    with services.sessions() as db:
        adapter, found = find_export_checkpoint(db, tenant.id, model_id, ref)
    if adapter.base_model != settings.base_model:
        raise InvalidRequestError(
            f"adapter {model_id!r} was trained on {adapter.base_model!r}; this service has {settings.base_model!r}"
        )
    folder = write_peft_folder(
        settings, found, out_dir, base_model=settings.base_model, base_model_path=adapter.base_model
    )
    return PeftExport(folder, tinker_path(found.model_id, CheckpointKind(found.kind), found.name), found.name)
