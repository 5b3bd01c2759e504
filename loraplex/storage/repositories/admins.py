"""Web admin accounts (operators, not tenants): create, look up, and the failed-login count behind the lockout.
Passwords arrive hashed (loraplex/admin/passwords.py); nothing here sees a plaintext password.

A login's outcome is one UPDATE each (`record_failure`, `record_success`), the count computed by the database from
the row as it is when the statement runs: parallel attempts on PostgreSQL (row lock) or SQLite (one writer) count
exactly, and a lock set by one cannot be missed by another."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from sqlalchemy import case, select, update
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

    def record_failure(self, username: str, max_failures: int, lockout_seconds: float) -> None:
        """Count a wrong password for `username` (nothing when there is no such account); every max_failures-th in a
        row locks the account for lockout_seconds. One UPDATE: the count is read and written by the database."""
        count = AdminAccount.failed_logins + 1
        until = utcnow() + timedelta(seconds=lockout_seconds)
        self.session.execute(
            update(AdminAccount)
            .where(AdminAccount.username == username)
            .values(failed_logins=count,
                    locked_until=case((count % max_failures == 0, until), else_=AdminAccount.locked_until))
            .execution_options(synchronize_session=False)
        )  # fmt: skip
        self.session.expire_all()

    def record_success(self, account_id: str, *, even_if_locked: bool) -> bool:
        """A right password: reset the count, note the time. Unless `even_if_locked`, only while the account is not
        locked at this moment (checked in the same UPDATE); False when it was, and nothing changed."""
        now = utcnow()
        statement = update(AdminAccount).where(AdminAccount.id == account_id)
        if not even_if_locked:
            statement = statement.where((AdminAccount.locked_until.is_(None)) | (AdminAccount.locked_until <= now))
        result = self.session.execute(
            statement.values(failed_logins=0, last_login_at=now).execution_options(synchronize_session=False)
        )
        self.session.expire_all()
        return bool(result.rowcount)  # type: ignore[attr-defined]

    def login_failed(self, account: AdminAccount, max_failures: int, lockout_seconds: float) -> None:
        self.record_failure(account.username, max_failures, lockout_seconds)

    def login_succeeded(self, account: AdminAccount) -> None:
        self.record_success(account.id, even_if_locked=True)

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
