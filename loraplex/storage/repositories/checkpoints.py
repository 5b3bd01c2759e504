"""Checkpoint records of one tenant's adapters (the files themselves live in the blob store), and how checkpoints are
addressed: `tinker://<model_id>/<weights|sampler_weights>/<name>` for clients, `<tenant>/<model>/<kind>/<name>` as the
blob key of the checkpoint's folder."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.repositories.adapters import AdapterRepository

TINKER_SCHEME = "tinker://"
# The path segment of each kind a client can address (Tinker's names), and back.
SEGMENT_BY_KIND = {CheckpointKind.STATE: "weights", CheckpointKind.SAMPLER: "sampler_weights"}
KIND_BY_SEGMENT = {segment: kind for kind, segment in SEGMENT_BY_KIND.items()}


class TinkerPath(NamedTuple):
    model_id: str
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        return tinker_path(self.model_id, self.kind, self.name)


def tinker_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    return f"{TINKER_SCHEME}{model_id}/{SEGMENT_BY_KIND[CheckpointKind(kind)]}/{name}"


def parse_tinker_path(path: str) -> TinkerPath:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>` -> its parts (InvalidRequestError when malformed)."""
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise InvalidRequestError(f"not a checkpoint path: {path!r} (expected tinker://<model_id>/weights/<name>)")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in KIND_BY_SEGMENT:
        raise InvalidRequestError(
            f"not a checkpoint path: {path!r} (expected tinker://<model_id>/<weights|sampler_weights>/<name>)"
        )
    return TinkerPath(parts[0], KIND_BY_SEGMENT[parts[1]], parts[2])


def parse_kind(value: str) -> CheckpointKind:
    """A kind as a URL names it: `weights` / `sampler_weights` (Tinker) or `state` / `sampler`."""
    if value in KIND_BY_SEGMENT:
        return KIND_BY_SEGMENT[value]
    if value in (CheckpointKind.STATE, CheckpointKind.SAMPLER):
        return CheckpointKind(value)
    raise NotFoundError(f"no checkpoint kind {value!r}: use weights or sampler_weights")


def checkpoint_blob_key(tenant_id: str, model_id: str, kind: CheckpointKind, name: str) -> str:
    """The blob key of a checkpoint's folder. Tinker model ids hold ':' (not a blob key character): it becomes '_'
    (native ids are hex, so no two adapters of a tenant map to one key)."""
    return f"{tenant_id}/{model_id.replace(':', '_')}/{CheckpointKind(kind).value}/{name}"


def expired_checkpoints(session: Session, now: datetime) -> list[Checkpoint]:
    """Every tenant's checkpoints whose expiry has passed (for the retention job, which is operator-side)."""
    stmt = select(Checkpoint).where(Checkpoint.expires_at.is_not(None), Checkpoint.expires_at <= now)
    return list(session.scalars(stmt.order_by(Checkpoint.expires_at)))


class CheckpointRepository:
    def __init__(self, session: Session, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def add(
        self,
        model_id: str,
        kind: CheckpointKind,
        name: str,
        blob_uri: str,
        size_bytes: int,
        sha256: str,
        step: int = 0,
        expires_at: datetime | None = None,
        *,
        include_deleted: bool = False,
        replace: bool = False,
    ) -> Checkpoint:
        """Record a saved checkpoint of a live adapter of this tenant; (model_id, kind, name) must be new, unless
        `replace` (the files were overwritten: the old row goes). `include_deleted` lets the dispatcher record a save
        that ran before a queued delete of the adapter."""
        AdapterRepository(self.session, self.tenant_id).get(model_id, include_deleted=include_deleted)
        if replace:
            old = self.find(model_id, kind, name)
            if old is not None:
                self.session.delete(old)
                self.session.flush()
        checkpoint = Checkpoint(
            model_id=model_id,
            tenant_id=self.tenant_id,
            kind=CheckpointKind(kind),
            name=name,
            blob_uri=blob_uri,
            size_bytes=size_bytes,
            sha256=sha256,
            step=step,
            expires_at=expires_at,
        )
        add_or_conflict(self.session, checkpoint, f"checkpoint {kind}/{name} of {model_id!r} already exists")
        return checkpoint

    def find(self, model_id: str, kind: CheckpointKind, name: str) -> Checkpoint | None:
        # Scoped by the checkpoint's own tenant_id, so checkpoints stay loadable after their adapter is deleted.
        return self.session.scalar(
            select(Checkpoint).where(
                Checkpoint.tenant_id == self.tenant_id,
                Checkpoint.model_id == model_id,
                Checkpoint.kind == CheckpointKind(kind),
                Checkpoint.name == name,
            )
        )

    def get(self, model_id: str, kind: CheckpointKind, name: str) -> Checkpoint:
        checkpoint = self.find(model_id, kind, name)
        if checkpoint is None:
            raise NotFoundError(f"checkpoint {kind}/{name} of {model_id!r} not found")
        return checkpoint

    def list(self, model_id: str, kind: CheckpointKind | None = None) -> list[Checkpoint]:
        stmt = select(Checkpoint).where(Checkpoint.tenant_id == self.tenant_id, Checkpoint.model_id == model_id)
        if kind is not None:
            stmt = stmt.where(Checkpoint.kind == CheckpointKind(kind))
        return list(self.session.scalars(stmt.order_by(Checkpoint.created_at, Checkpoint.name)))

    def latest(self, model_id: str, kinds: tuple[CheckpointKind, ...]) -> Checkpoint | None:
        """The most recently saved checkpoint of one of `kinds` (None when there is none)."""
        stmt = select(Checkpoint).where(
            Checkpoint.tenant_id == self.tenant_id,
            Checkpoint.model_id == model_id,
            Checkpoint.kind.in_([CheckpointKind(k) for k in kinds]),
        )
        return self.session.scalar(stmt.order_by(Checkpoint.created_at.desc(), Checkpoint.step.desc()).limit(1))

    def delete(self, model_id: str, kind: CheckpointKind, name: str) -> Checkpoint:
        """Remove the record and return it, so the caller can delete its blob once the transaction commits."""
        checkpoint = self.get(model_id, kind, name)
        self.session.delete(checkpoint)
        self.session.flush()
        return checkpoint
