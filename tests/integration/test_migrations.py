"""Migrations on SQLite and a real PostgreSQL: upgrade/downgrade round trip, and the ORM models match what the
migrations build (an autogenerate comparison finds nothing), so a model change without a migration fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from loraplex.storage.db import ALEMBIC_INI, current_revision, downgrade, make_engine, migrate
from loraplex.storage.models import Base
from tests.helpers.services.postgres import PostgresServer, postgres_server

pytestmark = pytest.mark.integration

APP_TABLES = {"tenants", "api_keys", "adapters", "checkpoints", "snapshots", "pools", "sessions", "usage"}
_db_numbers = count()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """Factory of URLs of fresh, empty databases on the parametrised backend."""
    if request.param == "sqlite":
        return lambda: f"sqlite:///{tmp_path / f'db{next(_db_numbers)}.sqlite'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return lambda: server.create_database(f"migrations_{next(_db_numbers)}")


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(new_database: Callable[[], str]) -> None:
    url = new_database()
    migrate(url)
    assert _tables(url) >= APP_TABLES and current_revision(url) == "0001_initial"
    downgrade(url, "base")
    assert _tables(url) & APP_TABLES == set() and current_revision(url) is None
    migrate(url)
    assert _tables(url) >= APP_TABLES and current_revision(url) == "0001_initial"


def test_models_match_migrations(new_database: Callable[[], str]) -> None:
    url = new_database()
    migrate(url)
    assert _schema_diff(url) == []


def test_alembic_command_line_reads_the_url_from_settings(new_database: Callable[[], str], tmp_path: Path) -> None:
    url = new_database()
    env = {**os.environ, "LORAPLEX_DATABASE_URL": url}
    alembic = [sys.executable, "-m", "alembic", "-c", str(ALEMBIC_INI)]
    # From an unrelated folder, as an operator would run it.
    subprocess.run([*alembic, "upgrade", "head"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert current_revision(url) == "0001_initial"
    subprocess.run([*alembic, "downgrade", "base"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert current_revision(url) is None


def test_concurrent_migrations_serialise(new_database: Callable[[], str]) -> None:
    url = new_database()
    code = "import sys; from loraplex.storage.db import migrate; migrate(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stderr=subprocess.PIPE) for _ in range(4)]
    failures = [p.stderr.read().decode() for p in procs if p.wait(timeout=120) != 0]  # type: ignore[union-attr]
    assert failures == []
    assert current_revision(url) == "0001_initial" and _schema_diff(url) == []
