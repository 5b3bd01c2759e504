"""Who is acting: the admin account of the request's session (admin/auth.py keeps its id there), by username, for
the audit log (service/audit.py)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from loraplex.admin.auth import SESSION_KEY
from loraplex.service.context import Services
from loraplex.storage.repositories import AdminRepository


async def acting_admin(request: Request, services: Services) -> str:
    held = request.session.get(SESSION_KEY)
    account_id = str(held[0]) if isinstance(held, list) and held else ""

    def read() -> str:
        with services.sessions() as db:
            account = AdminRepository(db).get(account_id) if account_id else None
            return account.username if account is not None else f"account {account_id or '?'}"

    return await run_in_threadpool(read)
