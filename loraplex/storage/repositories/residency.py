"""Where each rank of each pool keeps an adapter's live state (GPU slot, host memory, or a spill file), as the pool's
adapter store reports it after every plan. Not tenant data: written by the pool, read by operators."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, cast

from sqlalchemy import CursorResult, delete, select
from sqlalchemy.orm import Session

from loraplex.storage.enums import ResidencyTier
from loraplex.storage.models import Adapter, Residency
from loraplex.storage.types import utcnow


class TierChangeLike(Protocol):
    """What the store reports (workers/adapter_store.TierChange); tier None: the adapter is gone."""

    model_id: str
    tier: str | None
    slot: int | None
    location: str | None


class ResidencyRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def record(
        self, model_id: str, pool: str, rank: int, tier: str, slot: int | None = None, location: str | None = None
    ) -> Residency:
        """Insert or update the (model_id, pool, rank) row."""
        row = self.session.get(Residency, (model_id, pool, rank))
        if row is None:
            row = Residency(model_id=model_id, pool=pool, rank=rank)
            self.session.add(row)
        row.tier = ResidencyTier(tier)
        row.slot = slot
        row.location = location
        row.updated_at = utcnow()
        self.session.flush()
        return row

    def remove(self, model_id: str, pool: str, rank: int) -> None:
        self.session.execute(
            delete(Residency).where(Residency.model_id == model_id, Residency.pool == pool, Residency.rank == rank)
        )

    def clear(self, pool: str) -> int:
        """Remove every row of a pool (a starting pool: what they described is gone). Returns how many."""
        result = cast(CursorResult[Any], self.session.execute(delete(Residency).where(Residency.pool == pool)))
        return result.rowcount

    def record_changes(self, pool: str, rank: int, changes: Iterable[TierChangeLike]) -> int:
        """Apply a store's drained changes; adapters with no row in `adapters` (never registered through the gateway)
        are skipped. Returns the rows written or removed."""
        changes = list(changes)
        if not changes:
            return 0
        ids = {c.model_id for c in changes}
        known = set(self.session.scalars(select(Adapter.model_id).where(Adapter.model_id.in_(ids))))
        done = 0
        for change in changes:
            if change.model_id not in known:
                continue
            if change.tier is None:
                self.remove(change.model_id, pool, rank)
            else:
                self.record(change.model_id, pool, rank, change.tier, change.slot, change.location)
            done += 1
        return done

    def get(self, model_id: str, pool: str, rank: int = 0) -> Residency | None:
        return self.session.get(Residency, (model_id, pool, rank))

    def list(self, pool: str | None = None, rank: int | None = None) -> list[Residency]:
        stmt = select(Residency)
        if pool is not None:
            stmt = stmt.where(Residency.pool == pool)
        if rank is not None:
            stmt = stmt.where(Residency.rank == rank)
        return list(self.session.scalars(stmt.order_by(Residency.pool, Residency.rank, Residency.model_id)))
