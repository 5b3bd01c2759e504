"""Checkpoints made without a pool (gateway tests): files in the folder the gateway would choose, and the row the
dispatcher's recorder adds after a worker's save."""

from __future__ import annotations

from loraplex.protocol.checkpoint_paths import checkpoint_blob_key, tinker_path
from loraplex.storage.blobs import BlobStore
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories import CheckpointRepository, unit_of_work


def saved_checkpoint(services, tenant_id: str, model_id: str, kind: CheckpointKind, name: str, step: int = 3) -> str:
    """Record a finished save of `model_id` (a checkpoint.json in its folder, size 2, step `step`); its tinker path."""
    store = BlobStore(services.settings.resolved_blob_root)
    folder = store.path(checkpoint_blob_key(tenant_id, model_id, kind, name))
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text("{}")
    with unit_of_work(services.sessions) as session:
        CheckpointRepository(session, tenant_id).add(
            model_id, kind, name, folder.as_uri(), 2, "0" * 64, step=step, include_deleted=True
        )
    return tinker_path(model_id, kind, name)


def checkpoint_folder(services, tenant_id: str, model_id: str, kind: CheckpointKind, name: str):
    store = BlobStore(services.settings.resolved_blob_root)
    return store.path(checkpoint_blob_key(tenant_id, model_id, kind, name))
