"""Metered usage of one tenant: append-only records and their totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from loraplex.errors import InvalidRequestError
from loraplex.storage.models import Usage


@dataclass(frozen=True)
class KindTotals:
    tokens: int = 0
    seconds: float = 0.0
    records: int = 0


@dataclass(frozen=True)
class UsageTotals:
    tokens: int = 0
    seconds: float = 0.0
    records: int = 0
    by_kind: dict[str, KindTotals] = field(default_factory=dict)


def record_usage_of_tenants(session: Session, rows: dict[str, list[tuple[str | None, str, int, float]]]) -> None:
    """Several tenants' (model_id, kind, tokens, seconds) records, tenant id -> rows, in one INSERT (a plan's usage:
    the pool writes it for every tenant it served; the gateway's reads stay per tenant)."""
    if any(tokens < 0 or seconds < 0 for tenant_rows in rows.values() for _, _, tokens, seconds in tenant_rows):
        raise InvalidRequestError("usage tokens and seconds must be non-negative")
    values = [
        {"tenant_id": tenant_id, "model_id": m, "kind": k, "tokens": t, "seconds": float(sec)}
        for tenant_id, tenant_rows in rows.items()
        for m, k, t, sec in tenant_rows
    ]
    if values:  # on the session's connection (Core), as the record's other statements (repositories/pools.py)
        session.connection().execute(insert(Usage), values)


class UsageRepository:
    def __init__(self, session: Session, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def record(self, model_id: str | None, kind: str, tokens: int, seconds: float) -> Usage:
        if tokens < 0 or seconds < 0:
            raise InvalidRequestError("usage tokens and seconds must be non-negative")
        row = Usage(tenant_id=self.tenant_id, model_id=model_id, kind=kind, tokens=tokens, seconds=float(seconds))
        self.session.add(row)
        self.session.flush()
        return row

    def record_many(self, rows: list[tuple[str | None, str, int, float]]) -> None:
        """Several (model_id, kind, tokens, seconds) records in one INSERT (the dispatcher's per-plan usage)."""
        if any(tokens < 0 or seconds < 0 for _, _, tokens, seconds in rows):
            raise InvalidRequestError("usage tokens and seconds must be non-negative")
        if rows:
            self.session.execute(
                insert(Usage),
                [
                    {"tenant_id": self.tenant_id, "model_id": m, "kind": k, "tokens": t, "seconds": float(sec)}
                    for m, k, t, sec in rows
                ],
            )

    def totals(self, model_id: str | None = None, since: datetime | None = None) -> UsageTotals:
        """Sums over this tenant's records, optionally for one adapter and/or from `since` on."""
        stmt = select(Usage.kind, func.sum(Usage.tokens), func.sum(Usage.seconds), func.count()).where(
            Usage.tenant_id == self.tenant_id
        )
        if model_id is not None:
            stmt = stmt.where(Usage.model_id == model_id)
        if since is not None:
            stmt = stmt.where(Usage.created_at >= since)
        by_kind = {
            kind: KindTotals(int(tokens or 0), float(seconds or 0.0), int(count))
            for kind, tokens, seconds, count in self.session.execute(stmt.group_by(Usage.kind))
        }
        return UsageTotals(
            tokens=sum(k.tokens for k in by_kind.values()),
            seconds=sum(k.seconds for k in by_kind.values()),
            records=sum(k.records for k in by_kind.values()),
            by_kind=by_kind,
        )
