"""Checkpoint records of one tenant's adapters (the files themselves live in the blob store). How checkpoints are
addressed (tinker paths, blob keys) is `loraplex.checkpoint_paths`."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.errors import NotFoundError
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.repositories.adapters import AdapterRepository


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
