"""The admin's own login (sqladmin's AuthenticationBackend): admin accounts only, never a tenant's API key.

A login, in order: the per-client attempt limit (admin/login_limits.py: 429 + Retry-After), a short read of the
account, the per-account limit (skipped for a browser with the account's trusted-device cookie, admin/
trusted_devices.py), the scrypt check outside any transaction (one of `admin_login_checks_at_once` places), then the
outcome in one short write (AdminRepository.record_failure / record_success: single UPDATEs, so parallel attempts
count exactly). Every `admin_max_failed_logins`-th wrong password in a row locks the account for
`admin_lockout_seconds` against browsers without its trusted-device cookie; those keep logging in, so nobody can lock
an admin out of the browsers it uses. An unknown user, a wrong password and a locked account cost the same work
(a scrypt of the same cost, the same UPDATE) and get the same message, so a guesser learns nothing from either.
Log lines name the client and, for a known account, its id, never the typed username.

A good login stores (account id, session version) in a signed session cookie (Starlette's SessionMiddleware:
HttpOnly, SameSite=strict, max-age `admin_session_seconds`, Secure over HTTPS: admin/secure_cookies.py); each
request re-checks the account and its version, so `loraplex admin passwd` ends the sessions issued before it. A
lockout stops guessing, not the sessions already open."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqladmin.authentication import AuthenticationBackend
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from loraplex.admin.login_limits import LoginLimits
from loraplex.admin.passwords import verify_password
from loraplex.admin.secure_cookies import cookie_secure
from loraplex.admin.trusted_devices import TrustedDevices
from loraplex.errors import CapacityError
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.settings import Settings
from loraplex.storage.repositories import AdminRepository, unit_of_work

log = logging.getLogger("loraplex.admin")
refusals = RateLimitedLog(log)  # a flood of attempts past the limits writes one line a second, not one each
SESSION_KEY = "admin"
REFUSED = "wrong username or password, or the account is locked for a while"


def admin_secret(settings: Settings) -> str:
    """The cookie-signing secret: the setting, else one kept in home/admin-secret (created once, owner-only)."""
    if settings.admin_secret:
        return settings.admin_secret
    path = Path(settings.home) / "admin-secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
    return path.read_text().strip()


@dataclass(frozen=True)
class _Account:
    id: str
    username: str
    password_hash: str
    session_version: int


class AdminAuth(AuthenticationBackend):
    templates: Any = None  # the Admin's templates (set by admin/app.py once the Admin exists): the login page

    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        secret = admin_secret(settings)
        super().__init__(
            secret,
            session_cookie="loraplex_admin",
            max_age=settings.admin_session_seconds,
            same_site="strict",
            https_only=settings.admin_cookie_secure is True,
        )
        self.settings = settings
        self.sessions = sessions
        self.limits = LoginLimits(settings)
        self.devices = TrustedDevices(secret, settings.admin_trusted_device_days)

    async def login(self, request: Request) -> Response | bool:
        form = await request.form()
        username, password = str(form.get("username") or ""), str(form.get("password") or "")
        client = request.client.host if request.client else "unknown"
        try:
            account = await run_in_threadpool(self._check, request, client, username, password)
        except CapacityError as exc:
            refusals.log(logging.WARNING, "admin login from %s refused: %s", client, exc.message)
            await asyncio.sleep(self.settings.admin_login_refusal_delay_seconds)
            retry = str(int(exc.retry_after_s or 1))
            return await self._page(request, exc.message, 429, {"Retry-After": retry})
        if account is None:
            return await self._page(request, REFUSED, 400)
        request.session.clear()  # a fresh session: no fixation of one issued before the login
        request.session[SESSION_KEY] = [account.id, account.session_version]
        response = RedirectResponse(request.url_for("admin:index"), status_code=302)
        self.devices.issue(response, account.id, account.session_version,
                           secure=cookie_secure(self.settings, request.url.scheme))  # fmt: skip
        return response

    async def _page(
        self, request: Request, message: str, status: int, headers: dict[str, str] | None = None
    ) -> Response:
        page: Response = await self.templates.TemplateResponse(
            request, "sqladmin/login.html", {"error": message}, status_code=status
        )
        page.headers.update(headers or {})
        return page

    def _check(self, request: Request, client: str, username: str, password: str) -> _Account | None:
        """The account logged in to, or None (refused); CapacityError past a limit. No transaction is open while the
        password is hashed: the write lock (SQLite) is held only for the outcome's UPDATE."""
        self.limits.admit_client(client)
        account = self._read(username)
        trusted = account is not None and self.devices.vouches(request, account.id, account.session_version)
        if not trusted:
            self.limits.admit_account(username)
        with self.limits.checking():
            right = verify_password(password, account.password_hash if account else DUMMY_HASH)
        settings = self.settings
        with unit_of_work(self.sessions) as db:
            repo = AdminRepository(db)
            if account is None or not right:
                # For an unknown name this UPDATE matches no row: the same statement, the same time.
                repo.record_failure(username, settings.admin_max_failed_logins, settings.admin_lockout_seconds)
                accepted = False
            else:
                accepted = repo.record_success(account.id, even_if_locked=trusted)
        if accepted:
            return account
        known = f" at account {account.id}" if account is not None else ""
        why = "a locked account" if account is not None and right else "wrong username or password"
        log.warning("admin login from %s refused%s: %s", client, known, why)
        return None

    def _read(self, username: str) -> _Account | None:
        with self.sessions() as db:
            row = AdminRepository(db).find(username)
            return None if row is None else _Account(row.id, row.username, row.password_hash, row.session_version)

    async def logout(self, request: Request) -> bool:
        request.session.clear()
        return True

    async def authenticate(self, request: Request) -> bool:
        held = request.session.get(SESSION_KEY)
        if not (isinstance(held, list) and len(held) == 2):
            return False
        return await run_in_threadpool(self._still_valid, str(held[0]), held[1])

    def _still_valid(self, account_id: str, version: object) -> bool:
        with self.sessions() as db:  # a read: no write lock
            account = AdminRepository(db).get(account_id)
            return account is not None and account.session_version == version

    async def get_user_id(self, request: Request) -> str | None:
        held = request.session.get(SESSION_KEY)
        return str(held[0]) if isinstance(held, list) and held else None


# A real hash of a random password, checked against when the username does not exist.
DUMMY_HASH = "scrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
