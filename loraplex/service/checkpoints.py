"""Checkpoints of an adapter: save (state or sampler weights), load into the adapter, list, delete; and the tenant's
checkpoints across its adapters: list (paged), get, bulk delete, time to live, weights_info, all by tinker path.

Saves and loads are steps in the adapter's seq_id order (they return futures). The gateway validates the name and
chooses the folder in the blob store (`<tenant>/<model>/<kind>/<name>`); the payload carries its absolute path, so
the worker writes or reads there with no blob or SQL code of its own. The dispatcher's recorder adds the row once the
save succeeded. Checkpoints are reached by their tinker path, always through the tenant's repository: another
tenant's checkpoint is a 404, the same as a missing one."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, InvalidRequestError, QuotaExceededError
from loraplex.protocol import LoadStatePayload, RequestKind, SaveCheckpointPayload
from loraplex.protocol.checkpoint_paths import (
    MAX_TTL_SECONDS,
    SEGMENT_BY_KIND,
    TYPE_BY_KIND,
    CheckpointKind,
    TinkerPath,
    checkpoint_blob_key,
    parse_kind,
    parse_tinker_path,
    tinker_path,
    validate_checkpoint_name,
)
from loraplex.queue.keys import request_idempotency_key
from loraplex.queue.producer import Claim
from loraplex.service.checkpoint_quota import Reservation, reserve_save
from loraplex.service.context import Services, TenantRef, blob_store, write_session
from loraplex.service.paging import MAX_PAGE_LIMIT, check_page, cursor
from loraplex.service.rejections import fill_rejected, filling_rejections
from loraplex.service.schemas import (
    CheckpointOut,
    CheckpointPage,
    FutureRef,
    LoadStateRequest,
    SaveCheckpointRequest,
    WeightsInfoOut,
)
from loraplex.service.submit import already_submitted, submit
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository
from loraplex.storage.repositories.checkpoints import files_pending
from loraplex.storage.retention import delete_checkpoint_files
from loraplex.storage.types import utcnow

# Which target modules train attention and which the MLP (weights_info's train_attn / train_mlp).
ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})
MAX_DELETE_PATHS = MAX_PAGE_LIMIT  # paths per bulk delete
FILES_WAIT_S = 60.0  # longest a reader of a checkpoint's files (export, weights_info) waits for them


def checkpoint_dir(services: Services, checkpoint: Checkpoint) -> Path:
    """The folder of a recorded checkpoint (its URI checked to lie inside the blob store)."""
    store = blob_store(services)
    return store.path(store.key_for_uri(checkpoint.blob_uri))


def files_written(services: Services, tenant_id: str, checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint once its files are there. A sampler save is answered before the pool writes its files (about a
    second for 130 MB, pool/finish.py): its row is read again until they are, for up to FILES_WAIT_S, then a
    ConflictError saying to retry; a row deleted meanwhile is a 404."""
    deadline = time.monotonic() + FILES_WAIT_S
    kind, name, model_id = CheckpointKind(checkpoint.kind), checkpoint.name, checkpoint.model_id
    while files_pending(checkpoint):
        if time.monotonic() > deadline:
            path = tinker_path(model_id, kind, name)
            raise ConflictError(f"the files of {path} are still being written; try again in a few seconds")
        time.sleep(0.1)
        with services.sessions() as db:
            checkpoint = CheckpointRepository(db, tenant_id).get(model_id, kind, name)
    return checkpoint


def resolve_checkpoint(db: Session, tenant_id: str, path: str, with_optimizer: bool) -> Checkpoint:
    """The tenant's checkpoint a tinker path names (NotFoundError for a missing or foreign one)."""
    parsed = parse_tinker_path(path)
    checkpoint = CheckpointRepository(db, tenant_id).get(parsed.model_id, parsed.kind, parsed.name)
    if with_optimizer and checkpoint.kind != CheckpointKind.STATE:
        raise InvalidRequestError(f"{path} holds weights only (a sampler checkpoint): pass with_optimizer=false")
    return checkpoint


def checkpoint_out(c: Checkpoint) -> CheckpointOut:
    """Size and hash are None while the pool still writes the files of an answered sampler save."""
    kind = CheckpointKind(c.kind)
    pending = files_pending(c)
    return CheckpointOut(
        checkpoint_id=f"{SEGMENT_BY_KIND.get(kind, kind.value)}/{c.name}",
        checkpoint_type=TYPE_BY_KIND[kind],
        tinker_path=tinker_path(c.model_id, kind, c.name) if kind in SEGMENT_BY_KIND else "",
        model_id=c.model_id,
        kind=kind.value,
        name=c.name,
        size_bytes=None if pending else c.size_bytes,
        sha256=None if pending else c.sha256,
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
            exists = not retry and checkpoints.find(model_id, kind, name) is not None
            if exists and not request.overwrite:
                path = tinker_path(model_id, kind, name)
                raise ConflictError(f"checkpoint {path} already exists (pass overwrite=true)")
            base_model = adapter.base_model
            if retry:
                refused = _refused_earlier(services, model_id, request.seq_id)
                if refused is not None:
                    return refused
                reservation: Reservation | None = None
            else:
                try:
                    reservation = reserve_save(services, db, tenant, model_id, kind, overwrites=exists)
                except QuotaExceededError as exc:
                    # A 429 is not filled by filling_rejections (a queue quota frees by itself); this one does not,
                    # so the seq_id is filled here and the chain goes on (a retry gets the refusal's future).
                    fill_rejected(services, tenant, model_id, request.seq_id, request_kind, type(exc),
                                  exc.message)  # fmt: skip
                    raise
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
        try:
            ref = submit(services, tenant, model_id, request_kind, payload, seq_id=request.seq_id, pool=adapter.pool)
        except BaseException:
            if reservation is not None:
                reservation.cancel()
            raise
        if reservation is not None:
            reservation.bind(ref.request_id)
        return ref


def _refused_earlier(services: Services, model_id: str, seq_id: int) -> FutureRef | None:
    """The future of the rejection that fills (model_id, seq_id), if one does: a client that sends a refused save
    again (the Tinker SDK retries a 429) gets the refusal's future and its error, not a clash over the seq_id."""
    claim = services.redis.get(request_idempotency_key(RequestKind.REJECTED, model_id, seq_id))
    if claim is None:
        return None
    first = Claim.decode(claim.decode() if isinstance(claim, bytes) else str(claim))
    if first.kind != RequestKind.REJECTED.value:
        return None
    return FutureRef(request_id=first.request_id, model_id=model_id)


def load_state(services: Services, tenant: TenantRef, model_id: str, request: LoadStateRequest) -> FutureRef:
    """Load a checkpoint of this tenant into this (existing) adapter; a rank or target mismatch fails the future."""
    with filling_rejections(services, tenant, model_id, request.seq_id, RequestKind.LOAD_STATE):
        with services.sessions() as db:
            pool = AdapterRepository(db, tenant.id).get(model_id).pool
            checkpoint = resolve_checkpoint(db, tenant.id, request.path, request.with_optimizer)
        payload = LoadStatePayload(
            path=request.path, directory=str(checkpoint_dir(services, checkpoint)), with_optimizer=request.with_optimizer
        )
        return submit(services, tenant, model_id, RequestKind.LOAD_STATE, payload, seq_id=request.seq_id, pool=pool)


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


# ---- the tenant's checkpoints across its adapters, by tinker path --------------------------------------------------------
def list_all_checkpoints(services: Services, tenant: TenantRef, limit: int, offset: int) -> CheckpointPage:
    """Every checkpoint of the tenant (deleted adapters' too), newest first; 400 for a limit outside 1..1000 or a
    negative offset."""
    check_page(limit, offset)
    with services.sessions() as db:
        checkpoints = CheckpointRepository(db, tenant.id)
        total = checkpoints.count()
        rows = checkpoints.page(limit, offset)
        return CheckpointPage(checkpoints=[checkpoint_out(c) for c in rows], cursor=cursor(limit, offset, total))


def get_checkpoint(services: Services, tenant: TenantRef, path: str) -> CheckpointOut:
    """The tenant's checkpoint at a tinker path (400 for a malformed path, 404 for a missing or foreign one)."""
    parsed = parse_tinker_path(path)
    with services.sessions() as db:
        return checkpoint_out(CheckpointRepository(db, tenant.id).get(parsed.model_id, parsed.kind, parsed.name))


def delete_checkpoints(services: Services, tenant: TenantRef, paths: list[str]) -> list[CheckpointOut]:
    """Delete the checkpoints at `paths` (tinker paths, at most 1000; a path given twice counts once), all or none:
    a malformed path is a 400 and a missing or foreign one a 404 naming it, with nothing deleted. The files go once
    the rows' transaction has committed. Returns the deleted checkpoints, in the order given."""
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise InvalidRequestError("paths must be a list of tinker paths")
    if len(paths) > MAX_DELETE_PATHS:
        raise InvalidRequestError(f"{len(paths)} paths; at most {MAX_DELETE_PATHS} per delete")
    parsed: list[TinkerPath] = list(dict.fromkeys(parse_tinker_path(p) for p in paths))
    with write_session(services) as db:
        deleted = CheckpointRepository(db, tenant.id).delete_many(parsed)
        out = [checkpoint_out(c) for c in deleted]
        uris = [c.blob_uri for c in deleted]
    store = blob_store(services)
    for uri in uris:
        delete_checkpoint_files(store, uri)
    return out


def set_checkpoint_ttl(services: Services, tenant: TenantRef, path: str, ttl_seconds: int | None) -> CheckpointOut:
    """Expire the checkpoint `ttl_seconds` from now (the retention job then deletes it), or never with None. 400 for
    a ttl that is not a whole number of seconds from 1 to MAX_TTL_SECONDS (100 years)."""
    if ttl_seconds is not None and (
        isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 0 < ttl_seconds <= MAX_TTL_SECONDS
    ):
        raise InvalidRequestError(
            f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_SECONDS}, or null to keep the "
            f"checkpoint; got {ttl_seconds!r}"
        )
    parsed = parse_tinker_path(path)
    expires_at = None if ttl_seconds is None else utcnow() + timedelta(seconds=ttl_seconds)
    with write_session(services) as db:
        checkpoint = CheckpointRepository(db, tenant.id).set_expiry(parsed.model_id, parsed.kind, parsed.name, expires_at)
        return checkpoint_out(checkpoint)


def weights_info(services: Services, tenant: TenantRef, path: str) -> WeightsInfoOut:
    """What the weights at a tinker path are: base model, LoRA rank, which parts of the model they train."""
    parsed = parse_tinker_path(path)
    with services.sessions() as db:
        checkpoint = CheckpointRepository(db, tenant.id).get(parsed.model_id, parsed.kind, parsed.name)
        adapter = AdapterRepository(db, tenant.id).get(checkpoint.model_id, include_deleted=True)
    checkpoint = files_written(services, tenant.id, checkpoint)  # its size is known once they are written
    targets = {m.rsplit(".", 1)[-1] for m in adapter.target_modules}
    kind = CheckpointKind(checkpoint.kind)
    return WeightsInfoOut(
        base_model=adapter.base_model,
        lora_rank=adapter.rank,
        train_mlp=bool(targets & MLP_MODULES),
        train_attn=bool(targets & ATTENTION_MODULES),
        tinker_path=tinker_path(checkpoint.model_id, kind, checkpoint.name),
        model_id=checkpoint.model_id,
        kind=kind.value,
        checkpoint_type=TYPE_BY_KIND[kind],
        size_bytes=checkpoint.size_bytes,
        step=checkpoint.step,
    )
