"""Engine setup and programmatic migrations on SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

from loraplex.storage.db import alembic_config, current_revision, make_db_engine, migrate, session_factory, unit_of_work
from loraplex.storage.models import Adapter


def test_sqlite_engine_pragmas(tmp_path: Path) -> None:
    engine = make_db_engine(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'x.db'}")  # parent folders are created
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 10_000
    engine.dispose()


def test_foreign_keys_are_enforced(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    migrate(url)
    engine = make_db_engine(url)
    with pytest.raises(IntegrityError), unit_of_work(session_factory(engine)) as s:
        s.add(
            Adapter(model_id="m", tenant_id="nobody", base_model="t", rank=1, alpha=1.0, target_modules=["q"], seed=0)
        )
    engine.dispose()


def test_migrate_works_from_any_directory_and_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert current_revision(url) is None
    migrate(url)
    migrate(url)
    assert current_revision(url) == ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = make_db_engine(url)
    assert {"tenants", "api_keys", "adapters", "checkpoints", "residency", "pools", "sessions", "usage"} <= set(
        inspect(engine).get_table_names()
    )
    engine.dispose()


def test_in_memory_sqlite_shares_one_database(tmp_path: Path) -> None:
    engine = make_db_engine("sqlite://")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT x FROM t").scalar() == 1
    engine.dispose()
