"""Checkpoints of an adapter: save (state or sampler weights), load into the adapter, list, delete.

Saves and loads are steps in the adapter's seq_id order (they return futures). The gateway validates the name and
chooses the folder in the blob store (`<tenant>/<model>/<kind>/<name>`); the payload carries its absolute path, so
the worker writes or reads there with no blob or SQL code of its own. The dispatcher's recorder adds the row once the
save succeeded. Checkpoints are reached by their tinker path, always through the tenant's repository: another
tenant's checkpoint is a 404, the same as a missing one."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from loraplex.api.schemas import CheckpointOut, FutureRef, LoadStateRequest, SaveCheckpointRequest
from loraplex.api.service.context import Services, TenantRef, blob_store, write_session
from loraplex.api.service.rejections import filling_rejections
from loraplex.api.service.submit import already_submitted, submit
from loraplex.checkpoint_paths import (
    SEGMENT_BY_KIND,
    TYPE_BY_KIND,
    CheckpointKind,
    checkpoint_blob_key,
    parse_kind,
    parse_tinker_path,
    tinker_path,
    validate_checkpoint_name,
)
from loraplex.errors import ConflictError, InvalidRequestError
from loraplex.protocol import LoadStatePayload, RequestKind, SaveCheckpointPayload
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository
from loraplex.storage.retention import delete_checkpoint_files


def checkpoint_dir(services: Services, checkpoint: Checkpoint) -> Path:
    """The folder of a recorded checkpoint (its URI checked to lie inside the blob store)."""
    store = blob_store(services)
    return store.path(store.key_for_uri(checkpoint.blob_uri))


def resolve_checkpoint(db: Session, tenant_id: str, path: str, with_optimizer: bool) -> Checkpoint:
    """The tenant's checkpoint a tinker path names (NotFoundError for a missing or foreign one)."""
    parsed = parse_tinker_path(path)
    checkpoint = CheckpointRepository(db, tenant_id).get(parsed.model_id, parsed.kind, parsed.name)
    if with_optimizer and checkpoint.kind != CheckpointKind.STATE:
        raise InvalidRequestError(f"{path} holds weights only (a sampler checkpoint): pass with_optimizer=false")
    return checkpoint


def checkpoint_out(c: Checkpoint) -> CheckpointOut:
    kind = CheckpointKind(c.kind)
    return CheckpointOut(
        checkpoint_id=f"{SEGMENT_BY_KIND.get(kind, kind.value)}/{c.name}",
        checkpoint_type=TYPE_BY_KIND[kind],
        tinker_path=tinker_path(c.model_id, kind, c.name) if kind in SEGMENT_BY_KIND else "",
        model_id=c.model_id,
        kind=kind.value,
        name=c.name,
        size_bytes=c.size_bytes,
        sha256=c.sha256,
        step=c.step,
        time=c.created_at,
        expires_at=c.expires_at,
    )


def save_state(services: Services, tenant: TenantRef, model_id: str, request: SaveCheckpointRequest) -> FutureRef:
    """Weights + optimizer state. The future's result: {path: tinker://<model_id>/weights/<name>, size_bytes, ...}."""
    return _save(services, tenant, model_id, request, CheckpointKind.STATE, RequestKind.SAVE_STATE)


def save_weights_for_sampler(
    services: Services, tenant: TenantRef, model_id: str, request: SaveCheckpointRequest
) -> FutureRef:
    """Weights only. The future's result: {path: tinker://<model_id>/sampler_weights/<name>, ...}."""
    return _save(services, tenant, model_id, request, CheckpointKind.SAMPLER, RequestKind.SAVE_SAMPLER)


def _save(
    services: Services,
    tenant: TenantRef,
    model_id: str,
    request: SaveCheckpointRequest,
    kind: CheckpointKind,
    request_kind: RequestKind,
) -> FutureRef:
    with filling_rejections(services, tenant, model_id, request.seq_id, request_kind):
        with services.sessions() as db:
            adapter = AdapterRepository(db, tenant.id).get(model_id)  # 404 for unknown, deleted, or another tenant's
            name = validate_checkpoint_name(request.name)
            retry = already_submitted(services, request_kind, model_id, request.seq_id)
            checkpoints = CheckpointRepository(db, tenant.id)
            if not retry and not request.overwrite and checkpoints.find(model_id, kind, name) is not None:
                path = tinker_path(model_id, kind, name)
                raise ConflictError(f"checkpoint {path} already exists (pass overwrite=true)")
            base_model = adapter.base_model
        directory = blob_store(services).path(checkpoint_blob_key(tenant.id, model_id, kind, name))
        payload = SaveCheckpointPayload(
            name=name,
            path=tinker_path(model_id, kind, name),
            directory=str(directory),
            blob_uri=directory.as_uri(),
            ttl_seconds=request.ttl_seconds,
            base_model=base_model,
            overwrite=request.overwrite,
        )
        return submit(services, tenant, model_id, request_kind, payload, seq_id=request.seq_id)


def load_state(services: Services, tenant: TenantRef, model_id: str, request: LoadStateRequest) -> FutureRef:
    """Load a checkpoint of this tenant into this (existing) adapter; a rank or target mismatch fails the future."""
    with filling_rejections(services, tenant, model_id, request.seq_id, RequestKind.LOAD_STATE):
        with services.sessions() as db:
            AdapterRepository(db, tenant.id).get(model_id)
            checkpoint = resolve_checkpoint(db, tenant.id, request.path, request.with_optimizer)
        payload = LoadStatePayload(
            path=request.path, directory=str(checkpoint_dir(services, checkpoint)), with_optimizer=request.with_optimizer
        )
        return submit(services, tenant, model_id, RequestKind.LOAD_STATE, payload, seq_id=request.seq_id)


def list_checkpoints(services: Services, tenant: TenantRef, model_id: str) -> list[CheckpointOut]:
    """Checkpoints of an adapter of this tenant (also after the adapter was deleted), oldest first."""
    with services.sessions() as db:
        AdapterRepository(db, tenant.id).get(model_id, include_deleted=True)
        return [checkpoint_out(c) for c in CheckpointRepository(db, tenant.id).list(model_id)]


def delete_checkpoint(services: Services, tenant: TenantRef, model_id: str, kind: str, name: str) -> CheckpointOut:
    """Delete the row, then (once committed) the files. `kind`: weights | sampler_weights (or state | sampler)."""
    parsed = parse_kind(kind)
    with write_session(services) as db:
        AdapterRepository(db, tenant.id).get(model_id, include_deleted=True)
        checkpoint = CheckpointRepository(db, tenant.id).delete(model_id, parsed, name)
    delete_checkpoint_files(blob_store(services), checkpoint.blob_uri)
    return checkpoint_out(checkpoint)
