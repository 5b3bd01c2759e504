"""Checkpoint records of one tenant's adapters (the files themselves live in the blob store)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.errors import NotFoundError
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.repositories.adapters import AdapterRepository


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
    ) -> Checkpoint:
        """Record a saved checkpoint of a live adapter of this tenant; (model_id, kind, name) must be new."""
        AdapterRepository(self.session, self.tenant_id).get(model_id)
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

    def get(self, model_id: str, kind: CheckpointKind, name: str) -> Checkpoint:
        # Scoped by the checkpoint's own tenant_id, so checkpoints stay loadable after their adapter is deleted.
        checkpoint = self.session.scalar(
            select(Checkpoint).where(
                Checkpoint.tenant_id == self.tenant_id,
                Checkpoint.model_id == model_id,
                Checkpoint.kind == CheckpointKind(kind),
                Checkpoint.name == name,
            )
        )
        if checkpoint is None:
            raise NotFoundError(f"checkpoint {kind}/{name} of {model_id!r} not found")
        return checkpoint

    def list(self, model_id: str, kind: CheckpointKind | None = None) -> list[Checkpoint]:
        stmt = select(Checkpoint).where(Checkpoint.tenant_id == self.tenant_id, Checkpoint.model_id == model_id)
        if kind is not None:
            stmt = stmt.where(Checkpoint.kind == CheckpointKind(kind))
        return list(self.session.scalars(stmt.order_by(Checkpoint.created_at, Checkpoint.name)))

    def delete(self, model_id: str, kind: CheckpointKind, name: str) -> Checkpoint:
        """Remove the record and return it, so the caller can delete its blob once the transaction commits."""
        checkpoint = self.get(model_id, kind, name)
        self.session.delete(checkpoint)
        self.session.flush()
        return checkpoint
