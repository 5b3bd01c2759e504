"""The admin's own login (sqladmin's AuthenticationBackend): admin accounts only, never a tenant's API key.

A login checks the username and password against `admin_accounts` (scrypt, admin/passwords.py); a wrong password
counts toward the lockout (`admin_max_failed_logins` in a row lock the account for `admin_lockout_seconds`, and a
locked account is refused even with the right password). A good login stores (account id, session version) in a
signed session cookie (Starlette's SessionMiddleware: HttpOnly, SameSite=strict, max-age `admin_session_seconds`,
Secure with `admin_cookie_secure`); each request re-checks the account and its version, so `loraplex admin
passwd` ends the sessions issued before it. The same message answers an unknown user, a wrong password and a lock,
so a guesser learns nothing."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from sqladmin.authentication import AuthenticationBackend
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from loraplex.admin.passwords import verify_password
from loraplex.settings import Settings
from loraplex.storage.repositories import AdminRepository, unit_of_work

log = logging.getLogger("loraplex.admin")
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


class AdminAuth(AuthenticationBackend):
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        super().__init__(
            admin_secret(settings),
            session_cookie="loraplex_admin",
            max_age=settings.admin_session_seconds,
            same_site="strict",
            https_only=settings.admin_cookie_secure,
        )
        self.settings = settings
        self.sessions = sessions

    async def login(self, request: Request) -> bool:
        form = await request.form()
        username, password = str(form.get("username") or ""), str(form.get("password") or "")
        account = await run_in_threadpool(self._check, username, password)
        if account is None:
            return False
        request.session.clear()  # a fresh session: no fixation of one issued before the login
        request.session[SESSION_KEY] = account
        return True

    def _check(self, username: str, password: str) -> list[str | int] | None:
        with unit_of_work(self.sessions) as db:
            repo = AdminRepository(db)
            account = repo.find(username)
            if account is None:
                verify_password(password, DUMMY_HASH)  # the same work as a real check: no timing tell
                log.warning("admin login refused: no account %r", username[:64])
                return None
            if repo.locked(account):
                log.warning("admin login refused: %r is locked until %s", username, account.locked_until)
                return None
            if not verify_password(password, account.password_hash):
                repo.login_failed(account, self.settings.admin_max_failed_logins, self.settings.admin_lockout_seconds)
                log.warning("admin login refused: wrong password for %r", username)
                return None
            repo.login_succeeded(account)
            return [account.id, account.session_version]

    async def logout(self, request: Request) -> bool:
        request.session.clear()
        return True

    async def authenticate(self, request: Request) -> bool:
        held = request.session.get(SESSION_KEY)
        if not (isinstance(held, list) and len(held) == 2):
            return False
        return await run_in_threadpool(self._still_valid, str(held[0]), held[1])

    def _still_valid(self, account_id: str, version: object) -> bool:
        with unit_of_work(self.sessions) as db:
            account = AdminRepository(db).get(account_id)
            return account is not None and account.session_version == version and not AdminRepository.locked(account)

    async def get_user_id(self, request: Request) -> str | None:
        held = request.session.get(SESSION_KEY)
        return str(held[0]) if isinstance(held, list) and held else None


# A real hash of a random password, checked against when the username does not exist.
DUMMY_HASH = "scrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
