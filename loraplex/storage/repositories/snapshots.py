"""Durable adapter snapshots of a pool (the `adapter_snapshots` table): recorded by the pool's snapshot writer once the
file is on disk and every request it covers has its result stored; read newest first by a restarting pool. Not tenant
data: the pool knows adapters only from requests the gateway already authorised."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from loraplex.storage.enums import AdapterStatus
from loraplex.storage.models import Adapter, AdapterSnapshotRow

LIVE = (AdapterStatus.CREATING, AdapterStatus.READY)


@dataclass(frozen=True)
class SnapshotInfo:
    model_id: str
    version: int
    applied_seq_id: int
    step: int
    path: str
    sha256: str


def _info(row: AdapterSnapshotRow) -> SnapshotInfo:
    return SnapshotInfo(row.model_id, row.version, row.applied_seq_id, row.step, row.path, row.sha256)


class SnapshotRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def next_version(self, model_id: str) -> int:
        top = self.session.scalar(select(func.max(AdapterSnapshotRow.version)).where(AdapterSnapshotRow.model_id == model_id))
        return int(top or 0) + 1

    def add(
        self, model_id: str, pool: str, version: int, applied_seq_id: int, step: int, path: str, sha256: str, size: int
    ) -> None:
        self.session.add(
            AdapterSnapshotRow(
                model_id=model_id, pool=pool, version=version, applied_seq_id=applied_seq_id, step=step, path=path,
                sha256=sha256, size_bytes=size,
            )
        )  # fmt: skip
        self.session.flush()

    def newest_first(self, model_id: str) -> list[SnapshotInfo]:
        rows = self.session.scalars(
            select(AdapterSnapshotRow)
            .where(AdapterSnapshotRow.model_id == model_id)
            .order_by(AdapterSnapshotRow.version.desc())
        )
        return [_info(r) for r in rows]

    def live_adapters(self, pool: str) -> list[str]:
        """Adapters (not deleted, not failed) with a snapshot written by `pool`, sorted."""
        stmt = (
            select(AdapterSnapshotRow.model_id)
            .join(Adapter, Adapter.model_id == AdapterSnapshotRow.model_id)
            .where(AdapterSnapshotRow.pool == pool, Adapter.status.in_(LIVE))
            .distinct()
        )
        return sorted(self.session.scalars(stmt))

    def prune(self, model_id: str, keep: int) -> list[str]:
        """Drop all but the newest `keep` rows of an adapter; returns the dropped rows' paths (files to remove)."""
        rows = self.newest_first(model_id)[keep:]
        if rows:
            self.session.execute(
                delete(AdapterSnapshotRow).where(
                    AdapterSnapshotRow.model_id == model_id, AdapterSnapshotRow.version.in_([r.version for r in rows])
                )
            )
        return [r.path for r in rows]

    def forget(self, model_id: str) -> list[str]:
        """Every row of an adapter (it was deleted); returns their paths."""
        return self.prune(model_id, keep=0)


def live_status(session: Session, model_id: str) -> bool:
    """Whether an adapter exists and is neither deleted nor failed."""
    status = session.scalar(select(Adapter.status).where(Adapter.model_id == model_id))
    return status in LIVE
