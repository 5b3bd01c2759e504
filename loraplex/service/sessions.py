"""Client sessions (the Tinker SDK's `create_session`, heartbeat and `sessions/{id}/finish`).

A session groups the adapters a client created in it (Tinker model ids `<session_id>:train:<n>`). Policy for what
a session's end frees: when a session finishes (the SDK's `close()` or `with` exit) or expires (no heartbeat for
`LORAPLEX_SESSION_EXPIRY_SECONDS`, 10 minutes by default; the SDK beats every 10 s), each of its live adapters is
deleted through the queue, as `DELETE /v1/adapters/{id}` does: after the steps already queued for it, its slot and
host memory are freed. What outlives the session: its checkpoints (with their own TTLs) and the adapters' rows, so
`training_runs/{id}` still answers, and `create_training_client_from_state` resumes from a saved state. Save state
before closing to keep training state. Adapters made by the native client (no session) are never freed this way."""

from __future__ import annotations

import logging
from datetime import timedelta

from loraplex.errors import NotFoundError
from loraplex.queue import keys
from loraplex.service.adapters import delete_adapter
from loraplex.service.context import Services, TenantRef, write_session
from loraplex.service.free_text import check_storable
from loraplex.storage.repositories import AdapterRepository, SessionRepository, idle_sessions
from loraplex.storage.types import utcnow

log = logging.getLogger(__name__)

EXPIRED_REASON = "expired: no heartbeat"


def create_session(services: Services, tenant: TenantRef, tags: list[str], user_metadata: dict[str, object]) -> str:
    check_storable(tags, "tags")
    check_storable(user_metadata, "user_metadata")
    with write_session(services) as db:
        return SessionRepository(db, tenant.id).create(tags=tags, user_metadata=user_metadata)


def heartbeat(services: Services, tenant: TenantRef, session_id: str) -> None:
    """404 for an unknown or another tenant's session, 410 for a finished one."""
    with write_session(services) as db:
        SessionRepository(db, tenant.id).heartbeat(session_id)


def check_active(services: Services, tenant: TenantRef, session_id: str) -> None:
    """404 unknown or foreign, 410 finished: adapters join only a live session."""
    with services.sessions() as db:
        SessionRepository(db, tenant.id).get_active(session_id)


def finish_session(services: Services, tenant: TenantRef, session_id: str, reason: str) -> list[str]:
    """Finish the session (idempotent: the first reason stays) and free its live adapters; returns their ids."""
    with write_session(services) as db:
        SessionRepository(db, tenant.id).finish(session_id, reason)
        live = [a.model_id for a in AdapterRepository(db, tenant.id).list(session_id=session_id)]
    freed = []
    for model_id in live:
        try:
            delete_adapter(services, tenant, model_id)
            freed.append(model_id)
        except NotFoundError:
            pass  # deleted meanwhile (another finish, or the tenant)
    return freed


def reap_idle_sessions(services: Services) -> int:
    """Finish every session whose heartbeat is older than the expiry (one gateway at a time: a Redis lock), freeing
    their adapters. Returns how many it finished."""
    expiry = services.settings.session_expiry_seconds
    if expiry <= 0:
        return 0
    lock_ttl = max(1, int(services.settings.session_reap_seconds))
    if not services.redis.set(keys.session_reaper_lock(), "1", nx=True, ex=lock_ttl):
        return 0  # another gateway reaps this round
    with services.sessions() as db:
        idle = [(s.id, s.tenant_id) for s in idle_sessions(db, utcnow() - timedelta(seconds=expiry))]
    for session_id, tenant_id in idle:
        freed = finish_session(services, TenantRef(tenant_id, tenant_id), session_id, EXPIRED_REASON)
        log.info("session %s expired (no heartbeat for %.0f s): freed %d adapters", session_id, expiry, len(freed))
    return len(idle)
