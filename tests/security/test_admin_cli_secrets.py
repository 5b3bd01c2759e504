"""`loraplex migrate` names the database it brought to head without its password (the output
of a deploy script lands in CI logs and terminals)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.services.postgres import postgres_server

PASSWORD = "s3cret-Db-Passw0rd"


def test_migrate_prints_the_database_url_with_the_password_masked(tmp_path) -> None:
    with postgres_server() as server:  # trust authentication: any password is accepted, and must never be shown
        server.create_database("migrated")
        url = server.database_url("migrated").replace("postgres@", f"postgres:{PASSWORD}@")
        env = {**os.environ, "LORAPLEX_HOME": str(tmp_path), "LORAPLEX_DATABASE_URL": url}
        done = subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "migrate"], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout and PASSWORD not in done.stderr
    assert f"database at head: postgresql+psycopg://postgres:***@127.0.0.1:{server.port}/migrated" in done.stdout
