"""Wrong passwords tried in parallel must each count toward the lockout, on a real PostgreSQL (where
a read-modify-write of the count without a row lock lost updates: 39 wrong passwords never locked the account) and
on SQLite. Each attempt runs as the login does, in its own transaction on its own connection; a barrier lines them up
after they read the account on PostgreSQL, so every one of them writes the count while the others are in flight
(on SQLite a unit of work holds the write lock from its start, so there the attempts queue for it instead)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine

from loraplex.admin.passwords import hash_password
from loraplex.storage.db import make_db_engine, migrate, session_factory
from loraplex.storage.models import AdminAccount
from loraplex.storage.repositories import AdminRepository, unit_of_work
from tests.helpers.services.postgres import postgres_server

MAX_FAILURES = 5


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def sessions(request, tmp_path_factory) -> Iterator[Any]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('lockout') / 'db.sqlite'}"
        migrate(url)
        engine = make_db_engine(url)
        yield session_factory(engine)
        engine.dispose()
        return
    with postgres_server() as server:
        url = server.create_database("lockout")
        migrate(url)
        engine = create_engine(url, pool_size=48)  # a connection per attempt in flight (the default pool has 15)
        yield session_factory(engine)
        engine.dispose()


def _parallel_failures(sessions: Any, username: str, n: int) -> None:
    """n wrong-password outcomes recorded at once, each by a thread that first read the account (as the login does)."""
    lined_up = sessions.kw["bind"].dialect.name == "postgresql"
    ready = threading.Barrier(n)
    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            with unit_of_work(sessions) as db:
                repo = AdminRepository(db)
                account = repo.named(username)
                if lined_up:
                    ready.wait(timeout=30)
                repo.login_failed(account, MAX_FAILURES, lockout_seconds=600)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def _account(sessions: Any, username: str) -> AdminAccount:
    with sessions() as db:
        return AdminRepository(db).named(username)


@pytest.mark.parametrize("n", [MAX_FAILURES - 1, 39])
def test_parallel_wrong_passwords_count_exactly_and_lock_at_the_threshold(sessions, n: int) -> None:
    name = f"parallel-{n}"
    with unit_of_work(sessions) as db:
        AdminRepository(db).create(name, hash_password("a long enough password"))
    _parallel_failures(sessions, name, n)
    account = _account(sessions, name)
    assert account.failed_logins == n
    assert AdminRepository.locked(account) is (n >= MAX_FAILURES)
    if n < MAX_FAILURES:  # one more reaches the threshold
        _parallel_failures(sessions, name, MAX_FAILURES - n)
        account = _account(sessions, name)
        assert account.failed_logins == MAX_FAILURES and AdminRepository.locked(account)


def test_a_right_password_is_refused_once_parallel_failures_locked_the_account(sessions) -> None:
    with unit_of_work(sessions) as db:
        account_id = AdminRepository(db).create("raced", hash_password("a long enough password")).id
    _parallel_failures(sessions, "raced", MAX_FAILURES)
    with unit_of_work(sessions) as db:  # the lock is checked in the same UPDATE that accepts the login
        assert AdminRepository(db).record_success(account_id, even_if_locked=False) is False
    assert _account(sessions, "raced").failed_logins == MAX_FAILURES
