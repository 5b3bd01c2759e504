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
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from loraplex.storage.db import ALEMBIC_INI, alembic_config, current_revision, downgrade, make_db_engine, migrate
from loraplex.storage.models import Base
from tests.helpers.services.postgres import PostgresServer, postgres_server

APP_TABLES = {"tenants", "api_keys", "adapters", "checkpoints", "residency", "pools", "sessions", "usage"}
HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()  # the newest migration
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
    engine = make_db_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list[object]:
    engine = make_db_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(new_database: Callable[[], str]) -> None:
    url = new_database()
    migrate(url)
    assert _tables(url) >= APP_TABLES and current_revision(url) == HEAD
    downgrade(url, "base")
    assert _tables(url) & APP_TABLES == set() and current_revision(url) is None
    migrate(url)
    assert _tables(url) >= APP_TABLES and current_revision(url) == HEAD


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
    assert current_revision(url) == HEAD
    subprocess.run([*alembic, "downgrade", "base"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert current_revision(url) is None


def test_concurrent_migrations_serialise(new_database: Callable[[], str]) -> None:
    url = new_database()
    code = "import sys; from loraplex.storage.db import migrate; migrate(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stderr=subprocess.PIPE) for _ in range(4)]
    failures = [p.stderr.read().decode() for p in procs if p.wait(timeout=120) != 0]  # type: ignore[union-attr]
    assert failures == []
    assert current_revision(url) == HEAD and _schema_diff(url) == []


def test_the_residency_rows_survive_the_rename_both_ways(new_database: Callable[[], str]) -> None:
    """0002 renames `snapshots` (where each rank keeps an adapter) to `residency`, keeping the rows."""
    url = new_database()
    migrate(url, "0001_initial")
    db = make_db_engine(url)
    now = "2026-12-01 00:00:00+00:00"
    try:
        with db.begin() as conn:
            conn.execute(text(f"INSERT INTO tenants (id, name, created_at) VALUES ('t1', 'alice', '{now}')"))
            conn.execute(text(
                "INSERT INTO adapters (model_id, tenant_id, base_model, rank, alpha, target_modules, seed, status, "
                f"applied_seq_id, user_metadata, created_at) VALUES ('m1', 't1', 'tiny', 4, 8.0, '[]', 1, 'ready', "
                f"0, '{{}}', '{now}')"
            ))  # fmt: skip
            conn.execute(text(
                "INSERT INTO snapshots (model_id, pool, rank, tier, slot, location, updated_at) "
                f"VALUES ('m1', 'p', 0, 'disk', NULL, '/spill/m1', '{now}')"
            ))  # fmt: skip
        migrate(url)
        with db.connect() as conn:
            rows = conn.execute(text("SELECT model_id, pool, tier, location FROM residency")).all()
        assert [tuple(r) for r in rows] == [("m1", "p", "disk", "/spill/m1")] and "snapshots" not in _tables(url)
        downgrade(url, "0001_initial")
        with db.connect() as conn:
            rows = conn.execute(text("SELECT model_id, pool, tier, location FROM snapshots")).all()
        assert [tuple(r) for r in rows] == [("m1", "p", "disk", "/spill/m1")] and "residency" not in _tables(url)
    finally:
        db.dispose()
