"""Client sessions (Tinker `create_session` / heartbeat / finish) of one tenant."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.errors import GoneError, NotFoundError
from loraplex.storage.models import TrainingSession
from loraplex.storage.types import utcnow


class SessionRepository:
    def __init__(self, session: Session, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def create(self, tags: Sequence[str] | None = None, user_metadata: dict[str, Any] | None = None) -> str:
        now = utcnow()
        row = TrainingSession(
            tenant_id=self.tenant_id,
            tags=list(tags or []),
            user_metadata=dict(user_metadata or {}),
            created_at=now,
            last_heartbeat_at=now,
        )
        self.session.add(row)
        self.session.flush()
        return row.id

    def get(self, session_id: str) -> TrainingSession:
        row = self.session.scalar(
            select(TrainingSession).where(TrainingSession.id == session_id, TrainingSession.tenant_id == self.tenant_id)
        )
        if row is None:
            raise NotFoundError(f"session {session_id!r} not found")
        return row

    def get_active(self, session_id: str) -> TrainingSession:
        """The session, if not finished (GoneError: new adapters cannot join a finished session)."""
        row = self.get(session_id)
        if row.finished_at is not None:
            raise GoneError(f"session {session_id!r} is finished ({row.finish_reason})")
        return row

    def heartbeat(self, session_id: str) -> TrainingSession:
        """Mark the session alive. A finished (or expired) session raises GoneError (Tinker clients stop on 410)."""
        row = self.get_active(session_id)
        row.last_heartbeat_at = utcnow()
        self.session.flush()
        return row

    def finish(self, session_id: str, reason: str) -> TrainingSession:
        """Idempotent: finishing twice keeps the first time and reason."""
        row = self.get(session_id)
        if row.finished_at is None:
            row.finished_at = utcnow()
            row.finish_reason = reason[:255]
            self.session.flush()
        return row

    def list(self, active_only: bool = False) -> list[TrainingSession]:
        stmt = select(TrainingSession).where(TrainingSession.tenant_id == self.tenant_id)
        if active_only:
            stmt = stmt.where(TrainingSession.finished_at.is_(None))
        return list(self.session.scalars(stmt.order_by(TrainingSession.created_at, TrainingSession.id)))


def idle_sessions(session: Session, before: datetime, limit: int = 100) -> list[TrainingSession]:
    """Every tenant's unfinished sessions whose last heartbeat is older than `before` (operator-side: the session
    reaper, service/sessions.py)."""
    stmt = select(TrainingSession).where(
        TrainingSession.finished_at.is_(None), TrainingSession.last_heartbeat_at < before
    )
    return list(session.scalars(stmt.order_by(TrainingSession.last_heartbeat_at).limit(limit)))
