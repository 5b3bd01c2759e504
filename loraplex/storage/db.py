"""Engines, sessions, transactions and schema migrations.

SQLite notes (the default backend, shared by several processes: gateway, dispatcher, Celery workers):
- WAL journal + a busy timeout let readers run beside one writer and make writers wait instead of failing.
- pysqlite's own transaction handling breaks SAVEPOINT and defers BEGIN; we switch it off and emit BEGIN ourselves.
- `unit_of_work` opens its transaction with BEGIN IMMEDIATE: it takes the write lock up front (waiting on the busy
  timeout), so a read-then-write transaction cannot fail with SQLITE_BUSY when another process committed meanwhile.
  Plain sessions (reads) keep a deferred BEGIN and never block writers."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from loraplex.runtime.fsutil import PRIVATE_FILE_MODE, private_dirs
from loraplex.storage.statement_count import count_statements

SQLITE_BUSY_TIMEOUT_S = 30.0
# Execution option read by the SQLite "begin" hook: "DEFERRED" (default), "IMMEDIATE", or NO_BEGIN.
SQLITE_BEGIN_OPTION = "loraplex_sqlite_begin"
# No BEGIN at all: each statement is its own transaction (SQLite's autocommit). For a connection that sends one
# SELECT (`single_read`): the statement reads one consistent snapshot either way, and the BEGIN costs a statement.
NO_BEGIN = "NONE"

_REPO_ROOT = Path(__file__).resolve().parents[2]
ALEMBIC_INI = _REPO_ROOT / "alembic.ini"
MIGRATIONS_DIR = _REPO_ROOT / "migrations"


def make_db_engine(url: str | URL, *, echo: bool = False, sqlite_foreign_keys: bool = True) -> Engine:
    """Engine for `url`. `sqlite_foreign_keys=False` is for migrations only (SQLite batch table rebuilds). Its
    statements count in the process's statement_count.STATEMENTS."""
    url = make_url(url)
    if url.get_backend_name() != "sqlite":
        engine = create_engine(url, echo=echo, pool_pre_ping=True)
    else:
        engine = _sqlite_engine(url, echo=echo, foreign_keys=sqlite_foreign_keys)
    count_statements(engine)
    return engine


def _sqlite_engine(url: URL, *, echo: bool, foreign_keys: bool) -> Engine:
    database = url.database or ""
    in_memory = database in ("", ":memory:") or "mode=memory" in database
    kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}}
    if in_memory:
        kwargs["poolclass"] = StaticPool  # one shared connection, else every connection sees its own empty database
    elif not database.startswith("file:"):
        _private_sqlite_files(Path(database))
    engine = create_engine(url, echo=echo, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # driver autocommit; the "begin" hook below emits BEGIN
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        if not in_memory:
            _enable_wal(cursor)
            cursor.execute("PRAGMA synchronous = NORMAL")  # durable across app crashes in WAL mode
        cursor.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get(SQLITE_BEGIN_OPTION, "DEFERRED")
        if mode != NO_BEGIN:
            conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


def _private_sqlite_files(database: Path) -> None:
    """The database file owner-only (0600) before SQLite opens it, so that it, and its -wal and -shm files, which
    SQLite creates with the database file's mode, hold every tenant's rows for the owner's eyes only. Files made
    before this rule (0644 by the umask) are tightened here."""
    private_dirs(database.parent)
    os.close(os.open(database, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE))
    for path in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # another user's file stays as it is
            if stat.S_IMODE(path.stat().st_mode) != PRIVATE_FILE_MODE:
                os.chmod(path, PRIVATE_FILE_MODE)


def _enable_wal(cursor: Any) -> None:
    """Switch the database file to WAL (persistent: one switch serves every later connection). The switch needs the
    file's exclusive lock, and SQLite answers it SQLITE_BUSY at once, without the busy handler, when another process
    holds a lock at that moment (several processes migrating a new database at start did); so wait here, as the busy
    timeout would, and skip the switch when another process already made it."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.005
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def single_read(engine: Engine) -> Connection:
    """A plain connection (no ORM session) for one SELECT, without a transaction around it: on SQLite no BEGIN
    (NO_BEGIN; its isolation level stays as `_on_connect` set it), elsewhere the driver's autocommit (no BEGIN and
    ROLLBACK round trips; the pool resets it on return). One statement reads one consistent snapshot either way. The
    caller closes it (`with`); the hot checks read one row through it (storage/repositories/adapters.live_pool_of)."""
    connection = engine.connect()
    if engine.dialect.name == "sqlite":
        return connection.execution_options(**{SQLITE_BEGIN_OPTION: NO_BEGIN})
    return connection.execution_options(isolation_level="AUTOCOMMIT")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: rows returned from a unit of work stay readable after it commits and closes.
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def unit_of_work(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One write transaction: commits when the block ends, rolls back on any exception (nothing half-written)."""
    with factory() as session:
        if session.get_bind().dialect.name == "sqlite":
            session.connection(execution_options={SQLITE_BEGIN_OPTION: "IMMEDIATE"})
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(url: str | URL) -> Config:
    """Alembic config pointing at this repository's migrations, usable from any working directory."""
    config = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.exists() else Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Passed as an attribute, not `sqlalchemy.url`: configparser would choke on '%' in passwords.
    config.attributes["database_url"] = url if isinstance(url, str) else url.render_as_string(hide_password=False)
    config.attributes["configure_logging"] = False  # never reconfigure the host process's logging
    return config


def migrate(url: str | URL, revision: str = "head") -> None:
    """`alembic upgrade <revision>` (head by default). Safe to call at every start; a no-op when up to date."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """`alembic downgrade <revision>` ("base" removes every table)."""
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str | URL) -> str | None:
    """The revision the database is at, or None before the first migration."""
    db_engine = make_db_engine(url)
    try:
        with db_engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        db_engine.dispose()


def database_unavailable(exc: BaseException) -> bool:
    """`exc` says the database could not be reached or dropped the connection (a server stopped, crashed, restarting,
    in recovery; SQLite's lock wait exhausted): the same transaction can succeed once it is back. The pool waits
    for the database on these (storage/outage.retry_database); the gateway answers an OperationalError with 503
    (api/errors.py)."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def ping(session: Session) -> None:
    """A trivial query: raises (SQLAlchemyError) when the database cannot answer."""
    session.execute(text("SELECT 1"))
