"""Checkpoints of an adapter: save (state or sampler weights), load into the adapter, list, delete.

Saves and loads are steps in the adapter's seq_id order (they return futures). The gateway validates the name and
chooses the folder in the blob store (`<tenant>/<model>/<kind>/<name>`); the payload carries its absolute path, so
the worker writes or reads there with no blob or SQL code of its own. The dispatcher's recorder adds the row once the
save succeeded. Checkpoints are reached by their tinker path, always through the tenant's repository: another
tenant's checkpoint is a 404, the same as a missing one."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from sqlalchemy.orm import Session

from loraplex.api.deps import DbDep, Services, ServicesDep, TenantDep, write_session
from loraplex.api.schemas import (
    CheckpointListOut,
    CheckpointOut,
    FutureRef,
    LoadStateRequest,
    SaveCheckpointRequest,
)
from loraplex.api.submit import already_submitted, enqueue
from loraplex.dispatch.plan import RequestKind
from loraplex.errors import ConflictError, InvalidRequestError
from loraplex.storage.blobs import BlobStore
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository
from loraplex.storage.repositories.checkpoints import (
    SEGMENT_BY_KIND,
    checkpoint_blob_key,
    parse_kind,
    parse_tinker_path,
    tinker_path,
)
from loraplex.storage.retention import delete_checkpoint_files

router = APIRouter(prefix="/v1/adapters", tags=["checkpoints"])

_TYPE_BY_KIND = {CheckpointKind.STATE: "training", CheckpointKind.SAMPLER: "sampler", CheckpointKind.EXPORT: "export"}


def valid_name(name: str) -> str:
    """The workers' own rule (imported on first use: it brings torch along, which the gateway needs nowhere else)."""
    from loraplex.workers.checkpoint import validate_checkpoint_name

    return validate_checkpoint_name(name)


def blob_store(services: Services) -> BlobStore:
    return BlobStore(services.settings.resolved_blob_root)


def checkpoint_dir(services: Services, checkpoint: Checkpoint) -> Path:
    """The folder of a recorded checkpoint (its URI checked to lie inside the blob store)."""
    store = blob_store(services)
    return store.path(store.key_for_uri(checkpoint.blob_uri))


def resolve_path(db: Session, tenant_id: str, path: str, with_optimizer: bool) -> Checkpoint:
    """The tenant's checkpoint a tinker path names (NotFoundError for a missing or foreign one)."""
    parsed = parse_tinker_path(path)
    checkpoint = CheckpointRepository(db, tenant_id).get(parsed.model_id, parsed.kind, parsed.name)
    if with_optimizer and checkpoint.kind != CheckpointKind.STATE:
        raise InvalidRequestError(f"{path} holds weights only (a sampler checkpoint): pass with_optimizer=false")
    return checkpoint


def checkpoint_out(c: Checkpoint) -> CheckpointOut:
    kind = CheckpointKind(c.kind)
    segment = SEGMENT_BY_KIND.get(kind, kind.value)
    return CheckpointOut(
        checkpoint_id=f"{segment}/{c.name}",
        checkpoint_type=_TYPE_BY_KIND[kind],
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


def _save(
    model_id: str,
    body: SaveCheckpointRequest,
    kind: CheckpointKind,
    request_kind: RequestKind,
    tenant: TenantDep,
    db: DbDep,
    services: ServicesDep,
) -> FutureRef:
    adapter = AdapterRepository(db, tenant.id).get(model_id)  # 404 for unknown, deleted, or another tenant's
    name = valid_name(body.name)
    retry = already_submitted(services, request_kind, model_id, body.seq_id)
    if not retry and not body.overwrite and CheckpointRepository(db, tenant.id).find(model_id, kind, name) is not None:
        raise ConflictError(f"checkpoint {tinker_path(model_id, kind, name)} already exists (pass overwrite=true)")
    directory = blob_store(services).path(checkpoint_blob_key(tenant.id, model_id, kind, name))
    payload = {
        "name": name,
        "path": tinker_path(model_id, kind, name),
        "directory": str(directory),
        "blob_uri": directory.as_uri(),
        "ttl_seconds": body.ttl_seconds,
        "base_model": adapter.base_model,
        "overwrite": body.overwrite,
    }
    request_id = enqueue(
        services, tenant_id=tenant.id, model_id=model_id, seq_id=body.seq_id, kind=request_kind, payload=payload
    )
    return FutureRef(request_id=request_id, model_id=model_id)


@router.post("/{model_id}/save_state", status_code=202)
def save_state(
    model_id: str, body: SaveCheckpointRequest, tenant: TenantDep, db: DbDep, services: ServicesDep
) -> FutureRef:
    """Weights + optimizer state. The future's result: {path: tinker://<model_id>/weights/<name>, size_bytes, ...}."""
    return _save(model_id, body, CheckpointKind.STATE, RequestKind.SAVE_STATE, tenant, db, services)


@router.post("/{model_id}/save_weights_for_sampler", status_code=202)
def save_weights_for_sampler(
    model_id: str, body: SaveCheckpointRequest, tenant: TenantDep, db: DbDep, services: ServicesDep
) -> FutureRef:
    """Weights only. The future's result: {path: tinker://<model_id>/sampler_weights/<name>, ...}."""
    return _save(model_id, body, CheckpointKind.SAMPLER, RequestKind.SAVE_SAMPLER, tenant, db, services)


@router.post("/{model_id}/load_state", status_code=202)
def load_state(model_id: str, body: LoadStateRequest, tenant: TenantDep, db: DbDep, services: ServicesDep) -> FutureRef:
    """Load a checkpoint of this tenant into this (existing) adapter; a rank or target mismatch fails the future."""
    AdapterRepository(db, tenant.id).get(model_id)
    checkpoint = resolve_path(db, tenant.id, body.path, body.with_optimizer)
    payload = {
        "path": body.path,
        "directory": str(checkpoint_dir(services, checkpoint)),
        "with_optimizer": body.with_optimizer,
    }
    request_id = enqueue(
        services,
        tenant_id=tenant.id,
        model_id=model_id,
        seq_id=body.seq_id,
        kind=RequestKind.LOAD_STATE,
        payload=payload,
    )
    return FutureRef(request_id=request_id, model_id=model_id)


@router.get("/{model_id}/checkpoints")
def list_checkpoints(model_id: str, tenant: TenantDep, db: DbDep) -> CheckpointListOut:
    """Checkpoints of an adapter of this tenant (also after the adapter was deleted), oldest first."""
    AdapterRepository(db, tenant.id).get(model_id, include_deleted=True)
    return CheckpointListOut(
        checkpoints=[checkpoint_out(c) for c in CheckpointRepository(db, tenant.id).list(model_id)]
    )


@router.delete("/{model_id}/checkpoints/{kind}/{name}")
def delete_checkpoint(model_id: str, kind: str, name: str, tenant: TenantDep, services: ServicesDep) -> CheckpointOut:
    """Delete the row, then (once committed) the files. `kind`: weights | sampler_weights (or state | sampler)."""
    parsed = parse_kind(kind)
    with write_session(services) as db:
        AdapterRepository(db, tenant.id).get(model_id, include_deleted=True)
        checkpoint = CheckpointRepository(db, tenant.id).delete(model_id, parsed, name)
    delete_checkpoint_files(blob_store(services), checkpoint.blob_uri)
    return checkpoint_out(checkpoint)
