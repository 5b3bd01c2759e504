"""The admin's audit log: every operator action (who, what, on which row, when, its parameters). The controls of
service/tenant_controls.py write their entry in the action's own transaction; the admin's other actions (each a
service call with transactions of its own) write theirs after the call succeeded, with `record_admin_action`."""

from __future__ import annotations

from loraplex.service.context import Services, write_session
from loraplex.storage.models import AdminAuditEntry
from loraplex.storage.repositories import AuditRepository


def record_admin_action(
    services: Services,
    actor: str,
    action: str,
    target_kind: str,
    target_id: str,
    target_name: str | None = None,
    detail: str | None = None,
) -> None:
    with write_session(services) as db:
        AuditRepository(db).record(actor, action, target_kind, target_id, target_name, detail)


def recent_admin_actions(services: Services, limit: int = 100, target_id: str | None = None) -> list[AdminAuditEntry]:
    """Newest first (detached rows, read-only)."""
    with services.sessions() as db:
        rows = AuditRepository(db).recent(limit, target_id)
        db.expunge_all()
        return rows
