"""Web admin accounts (operators, not tenants): create, look up, and the failed-login count behind the lockout.
Passwords arrive hashed (loraplex/admin/passwords.py); nothing here sees a plaintext password."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.storage.models import AdminAccount
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.types import utcnow

_NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class AdminRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def create(self, username: str, password_hash: str) -> AdminAccount:
        if not isinstance(username, str) or not _NAME_RE.fullmatch(username):
            raise InvalidRequestError("an admin username must be 1-64 characters of A-Z a-z 0-9 _ . @ -")
        if self.find(username) is not None:
            raise ConflictError(f"admin {username!r} already exists")
        account = AdminAccount(username=username, password_hash=password_hash)
        add_or_conflict(self.session, account, f"admin {username!r} already exists")
        return account

    def find(self, username: str) -> AdminAccount | None:
        return self.session.scalar(select(AdminAccount).where(AdminAccount.username == username))

    def get(self, account_id: str) -> AdminAccount | None:
        return self.session.get(AdminAccount, account_id)

    def named(self, username: str) -> AdminAccount:
        account = self.find(username)
        if account is None:
            raise NotFoundError(f"admin {username!r} not found")
        return account

    def list(self) -> list[AdminAccount]:
        return list(self.session.scalars(select(AdminAccount).order_by(AdminAccount.username)))

    @staticmethod
    def locked(account: AdminAccount, now: datetime | None = None) -> bool:
        return account.locked_until is not None and account.locked_until > (now or utcnow())

    def login_failed(self, account: AdminAccount, max_failures: int, lockout_seconds: float) -> None:
        """Count a wrong password; the max_failures-th in a row locks the account for lockout_seconds."""
        account.failed_logins += 1
        if account.failed_logins >= max_failures:
            account.locked_until = utcnow() + timedelta(seconds=lockout_seconds)
            account.failed_logins = 0
        self.session.flush()

    def login_succeeded(self, account: AdminAccount) -> None:
        account.failed_logins = 0
        account.last_login_at = utcnow()
        self.session.flush()

    def unlock(self, username: str) -> None:
        account = self.named(username)
        account.locked_until, account.failed_logins = None, 0
        self.session.flush()

    def set_password(self, username: str, password_hash: str) -> None:
        """A new password ends every session issued under the old one (session_version)."""
        account = self.named(username)
        account.password_hash = password_hash
        account.session_version += 1
        self.session.flush()
