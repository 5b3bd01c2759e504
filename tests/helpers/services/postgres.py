"""A throwaway PostgreSQL 15 cluster for tests: `with postgres_server() as pg: engine = make_db_engine(pg.url)`.

initdb refuses to run as root, so as root every server command runs as the `postgres` user (the data folder is
chowned to it); as any other user they run directly. fsync is off and the cluster is deleted afterwards.

Fault tests restart it: `pg.crash()` is `pg_ctl stop -m immediate` (every backend killed, no checkpoint: the next
start runs crash recovery from the WAL, as after a power cut of the server alone), `pg.start()` starts it again on the
same data folder and port."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loraplex.runtime.netutil import free_port
from tests.helpers.processes import running

PG_BIN = Path(os.environ.get("LORAPLEX_PG_BIN", "/usr/lib/postgresql/15/bin"))


@dataclass(frozen=True)
class PostgresServer:
    port: int
    directory: Path

    @property
    def url(self) -> str:
        """URL of the default `postgres` database."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def create_database(self, name: str) -> str:
        """Create an empty database and return its URL (keeps tests of different modules apart)."""
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.database_url(name)

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def log(self) -> Path:
        return self.directory / "log"

    def start(self) -> None:
        """`pg_ctl start` on this port, waiting until it accepts connections (after crash recovery, if any)."""
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        _run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-o", options, "start"])

    def postmaster_pid(self) -> int | None:
        """The running server's pid (the first line of postmaster.pid); None when it is not running."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def crash(self) -> None:
        """`pg_ctl stop -m immediate`: the server quits at once, killing every backend (clients see their
        connections drop), without a shutdown checkpoint. Returns once the postmaster is gone: `pg_ctl -w` returns when
        its pid file is, which the postmaster removes a moment before it exits."""
        pid = self.postmaster_pid()
        _run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        deadline = time.monotonic() + 10.0
        while pid is not None and running(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"postmaster {pid} still running 10 s after pg_ctl stop")
            time.sleep(0.01)


def _as_server_user(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


def _run(args: list[str]) -> None:
    result = subprocess.run(_as_server_user(args), capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a fresh cluster on a free port; stop it (immediate) and delete its folder on exit."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"PostgreSQL binaries not found in {PG_BIN} (set LORAPLEX_PG_BIN)")
    # Directly under /tmp: pytest's tmp folders are 0700 root, which the postgres user cannot enter.
    directory = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    if os.geteuid() == 0:
        server_user = pwd.getpwnam("postgres")
        os.chown(directory, server_user.pw_uid, server_user.pw_gid)
    data, log = directory / "data", directory / "log"
    started = False
    try:
        _run([str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"])
        # A free port can be taken between our probe and the server's bind: retry a few times.
        for attempt in range(5):
            server = PostgresServer(port=free_port(), directory=directory)
            try:
                server.start()
                started = True
                break
            except RuntimeError:
                if attempt == 4:
                    raise RuntimeError(f"PostgreSQL did not start; log:\n{_read(log)}") from None
        yield server
    finally:
        if started:
            subprocess.run(
                _as_server_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(directory, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()[-4000:]
    except OSError:
        return ""
