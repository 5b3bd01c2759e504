"""Alembic environment. The URL comes from `config.attributes["database_url"]` (set by `loraplex.storage.db.migrate`)
or from LORAPLEX_DATABASE_URL through loraplex.settings (the `alembic` command line)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, text

from loraplex.storage.db import SQLITE_BEGIN_OPTION, make_db_engine
from loraplex.storage.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
# Arbitrary constant: PostgreSQL advisory lock that serialises concurrent `migrate()` calls (several replicas starting).
_PG_MIGRATION_LOCK = 0x4C4F5241


def _database_url() -> str:
    url = config.attributes.get("database_url")
    if url:
        return str(url)
    from loraplex.settings import get_settings

    return get_settings().resolved_database_url


def _configure(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,  # SQLite cannot ALTER most things; batch mode rebuilds the table
        # Our SQLite engine emits real BEGINs, so DDL there is transactional too: a failed upgrade leaves nothing behind.
        transactional_ddl=True if sqlite else None,
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = _database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    external = config.attributes.get("connection")
    if external is not None:
        _configure(external)
        with context.begin_transaction():
            context.run_migrations()
        return

    # Foreign keys off on SQLite: batch-mode rebuilds drop and recreate tables that others reference.
    engine = make_db_engine(_database_url(), sqlite_foreign_keys=False)
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "sqlite":
                # Take the write lock up front so two processes migrating at once run one after the other.
                connection = connection.execution_options(**{SQLITE_BEGIN_OPTION: "IMMEDIATE"})
            _configure(connection)
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
