"""The admin's audit log (`admin_audit`): one row per operator action, appended, read newest first."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.storage.models import AdminAuditEntry

DETAIL_CHARS = 2000  # a long parameter (a pasted reason) is kept cut, not refused: the action itself was valid


class AuditRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def record(
        self, actor: str, action: str, target_kind: str, target_id: str, target_name: str | None, detail: str | None
    ) -> AdminAuditEntry:
        row = AdminAuditEntry(
            actor=actor[:64],
            action=action[:64],
            target_kind=target_kind[:32],
            target_id=target_id[:128],
            target_name=None if target_name is None else target_name[:255],
            detail=None if detail is None else detail[:DETAIL_CHARS],
        )
        self.session.add(row)
        self.session.flush()
        return row

    def recent(self, limit: int = 100, target_id: str | None = None) -> list[AdminAuditEntry]:
        stmt = select(AdminAuditEntry).order_by(AdminAuditEntry.created_at.desc(), AdminAuditEntry.id.desc())
        if target_id is not None:
            stmt = stmt.where(AdminAuditEntry.target_id == target_id)
        return list(self.session.scalars(stmt.limit(limit)))
