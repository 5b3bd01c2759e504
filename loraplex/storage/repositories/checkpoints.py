"""Checkpoint records of one tenant's adapters (the files themselves live in the blob store). How checkpoints are
addressed (tinker paths, blob keys) is `loraplex.protocol.checkpoint_paths`."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.errors import NotFoundError
from loraplex.protocol.checkpoint_paths import TinkerPath
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Checkpoint
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.repositories.adapters import AdapterRepository

# The sha256 of a row whose files are still being written: a sampler save is answered once its weights are copied and
# its save is in the durable request log; the pool fills in size and hash when the files are there (pool/finish.py),
# or rebuilds them after a crash (pool/durable/pending_files.py).
FILES_PENDING = ""


def files_pending(checkpoint: Checkpoint) -> bool:
    return checkpoint.sha256 == FILES_PENDING


def expired_checkpoints(session: Session, now: datetime) -> list[Checkpoint]:
    """Every tenant's checkpoints whose expiry has passed (for the retention job, which is operator-side), except those
    whose files the pool is still writing (a sampler save is answered first): deleted now, the writer would leave
    files behind a deleted row; they go at the next sweep after their files land."""
    stmt = select(Checkpoint).where(
        Checkpoint.expires_at.is_not(None), Checkpoint.expires_at <= now, Checkpoint.sha256 != FILES_PENDING
    )
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

    def settle(self, checkpoint_id: str, size_bytes: int, sha256: str) -> bool:
        """The files of a row recorded while they were being written are there: False when the row is gone (deleted,
        or replaced by a newer save of the same name)."""
        checkpoint = self.session.get(Checkpoint, checkpoint_id)
        if checkpoint is None or checkpoint.tenant_id != self.tenant_id:
            return False
        checkpoint.size_bytes, checkpoint.sha256 = size_bytes, sha256
        self.session.flush()
        return True

    def pending(self, model_id: str) -> builtins.list[Checkpoint]:
        """The adapter's checkpoints whose files are still being written (oldest first)."""
        return [c for c in self.list(model_id) if files_pending(c)]

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

    def count(self) -> int:
        """Checkpoints of this tenant, every adapter's (deleted adapters' too)."""
        stmt = select(func.count()).select_from(Checkpoint).where(Checkpoint.tenant_id == self.tenant_id)
        return int(self.session.execute(stmt).scalar_one())

    def usage(self) -> tuple[int, int]:
        """(checkpoints, bytes they hold) of this tenant, every adapter's (deleted adapters' too): its quotas' use."""
        stmt = select(func.count(), func.coalesce(func.sum(Checkpoint.size_bytes), 0)).where(
            Checkpoint.tenant_id == self.tenant_id
        )
        count, size = self.session.execute(stmt).one()
        return int(count), int(size)

    def page(self, limit: int, offset: int) -> builtins.list[Checkpoint]:
        """Checkpoints of this tenant across its adapters, newest first (ties: higher step, then name, then kind)."""
        stmt = (
            select(Checkpoint)
            .where(Checkpoint.tenant_id == self.tenant_id)
            .order_by(
                Checkpoint.created_at.desc(),
                Checkpoint.step.desc(),
                Checkpoint.model_id,
                Checkpoint.name,
                Checkpoint.kind,
            )
            .limit(limit)
            .offset(offset)
        )
        return list(self.session.scalars(stmt))

    def latest_of(self, model_ids: Iterable[str]) -> dict[tuple[str, CheckpointKind], Checkpoint]:
        """The newest checkpoint of each kind of each of `model_ids` (one query): (model_id, kind) -> checkpoint;
        a pair with no checkpoint is absent."""
        ids = sorted(set(model_ids))
        if not ids:
            return {}
        newest = (
            func.row_number()
            .over(
                partition_by=(Checkpoint.model_id, Checkpoint.kind),
                order_by=(Checkpoint.created_at.desc(), Checkpoint.step.desc(), Checkpoint.name.desc()),
            )
            .label("newest")
        )
        ranked = (
            select(Checkpoint.id, newest)
            .where(Checkpoint.tenant_id == self.tenant_id, Checkpoint.model_id.in_(ids))
            .subquery()
        )
        stmt = select(Checkpoint).join(ranked, Checkpoint.id == ranked.c.id).where(ranked.c.newest == 1)
        return {(c.model_id, CheckpointKind(c.kind)): c for c in self.session.scalars(stmt)}

    def get_many(self, paths: Sequence[TinkerPath]) -> builtins.list[Checkpoint]:
        """The checkpoints `paths` name, in their order (one query); NotFoundError naming the first path that is
        missing or another tenant's (the same message for both)."""
        if not paths:
            return []
        stmt = select(Checkpoint).where(
            Checkpoint.tenant_id == self.tenant_id,
            Checkpoint.model_id.in_(sorted({p.model_id for p in paths})),
            Checkpoint.name.in_(sorted({p.name for p in paths})),
        )
        found = {(c.model_id, CheckpointKind(c.kind), c.name): c for c in self.session.scalars(stmt)}
        rows: builtins.list[Checkpoint] = []
        for path in paths:
            row = found.get((path.model_id, CheckpointKind(path.kind), path.name))
            if row is None:
                raise NotFoundError(f"checkpoint {path} not found")
            rows.append(row)
        return rows

    def delete_many(self, paths: Sequence[TinkerPath]) -> builtins.list[Checkpoint]:
        """Remove every record `paths` name, or none: a missing or foreign path raises NotFoundError (naming it)
        before anything is deleted. Returns the rows, so the caller deletes their files once the transaction
        commits."""
        rows = self.get_many(paths)
        for row in rows:
            self.session.delete(row)
        self.session.flush()
        return rows

    def set_expiry(self, model_id: str, kind: CheckpointKind, name: str, expires_at: datetime | None) -> Checkpoint:
        """Set (or, with None, clear) when the retention job deletes this checkpoint."""
        checkpoint = self.get(model_id, kind, name)
        checkpoint.expires_at = expires_at
        self.session.flush()
        return checkpoint

    def delete(self, model_id: str, kind: CheckpointKind, name: str) -> Checkpoint:
        """Remove the record and return it, so the caller can delete its blob once the transaction commits."""
        checkpoint = self.get(model_id, kind, name)
        self.session.delete(checkpoint)
        self.session.flush()
        return checkpoint
