"""PEFT export of a saved checkpoint, shared by `loraplex export` (operator side) and the gateway's export route
(`GET /v1/adapters/{model_id}/export`, tenant side): find the tenant's checkpoint (the latest one by default), read it
from the blob store (every file's sha256 verified) and write the PEFT folder with `workers/export.export_peft`, the
base model's tokenizer along.

torch comes in only inside `write_peft_folder` (the gateway imports this module but loads torch only when it exports).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.protocol.checkpoint_paths import CheckpointKind, parse_checkpoint_ref, tinker_path
from loraplex.storage.blobs import BlobStore
from loraplex.storage.models import Adapter, Checkpoint
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository

if TYPE_CHECKING:
    from loraplex.settings import Settings

# What can be exported (an export never needs the optimizer state, so a state checkpoint serves as well).
EXPORTABLE_KINDS = (CheckpointKind.SAMPLER, CheckpointKind.STATE)


def find_export_checkpoint(
    session: Session, tenant_id: str, model_id: str, ref: str | None = None
) -> tuple[Adapter, Checkpoint]:
    """The tenant's adapter (deleted ones too) and the checkpoint to export: `ref` (a tinker path or `<kind>/<name>`,
    see checkpoint_paths.parse_checkpoint_ref) or, by default, the latest sampler or state checkpoint. NotFoundError
    for another tenant's adapter or checkpoint, a missing one, or an adapter with nothing saved yet."""
    adapter = AdapterRepository(session, tenant_id).get(model_id, include_deleted=True)
    checkpoints = CheckpointRepository(session, tenant_id)
    if ref is not None:
        kind, name = parse_checkpoint_ref(model_id, ref)
        return adapter, checkpoints.get(model_id, kind, name)
    latest = checkpoints.latest(model_id, EXPORTABLE_KINDS)
    if latest is None:
        raise NotFoundError(
            f"adapter {model_id!r} has no saved checkpoint to export: save one first "
            "(TrainingClient.save_weights_for_sampler(name) or save_state(name)), then export again"
        )
    return adapter, latest


def write_peft_folder(
    settings: Settings,
    checkpoint: Checkpoint,
    out_dir: Path,
    *,
    base_model: str,
    base_model_path: str | None = None,
) -> Path:
    """Write `checkpoint` as a PEFT folder into `out_dir` (returned): adapter_model.safetensors + adapter_config.json +
    the tokenizer of `base_model` (resolved in settings' model cache). adapter_config.json's base_model_name_or_path is
    `base_model_path`, by default that resolved local folder. A tampered or truncated checkpoint: InvalidRequestError,
    nothing written."""
    from loraplex.models import resolve
    from loraplex.workers.state.checkpoint import read_checkpoint
    from loraplex.workers.state.export import export_peft

    blobs = BlobStore(settings.resolved_blob_root)
    try:
        state = read_checkpoint(blobs.path(blobs.key_for_uri(checkpoint.blob_uri)))  # every file's sha256 verified
    except InvalidRequestError as exc:
        kind = CheckpointKind(checkpoint.kind)
        raise InvalidRequestError(
            f"checkpoint {tinker_path(checkpoint.model_id, kind, checkpoint.name)} cannot be exported: {exc.message}"
        ) from None
    base_dir = resolve(base_model, settings.resolved_model_cache).resolve()
    return export_peft(
        state,
        out_dir,
        base_model_path=str(base_dir) if base_model_path is None else base_model_path,
        tokenizer_dir=base_dir,
    )


__all__ = ["EXPORTABLE_KINDS", "find_export_checkpoint", "parse_checkpoint_ref", "write_peft_folder"]
