"""A throwaway redis-server for tests: `with redis_server() as url: r = redis.Redis.from_url(url)`. The product's own
child-process runner (loopback, no persistence, SHUTDOWN NOSAVE, reaped) is what the tests use too."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from loraplex.runtime.netutil import free_port
from loraplex.runtime.redis_child import RedisChild


@contextmanager
def redis_server() -> Iterator[str]:
    """Start redis-server on a free port, yield its URL (`redis://127.0.0.1:PORT/0`), shut it down on exit."""
    with RedisChild(persist=False) as child:
        yield child.url


class KillableRedis:
    """A redis-server on a fixed port that a test can SIGKILL and start again on the same port (fault tests).
    `persistent=True`: append-only file fsynced on every write, so a restart brings back the streams, consumer groups
    and pending entries (what a production Redis with AOF does); False: it comes back empty."""

    def __init__(self, workdir: Path, persistent: bool = True, port: int | None = None) -> None:
        self.workdir = workdir
        self.persistent = persistent
        self.port = port or free_port()
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, persistent: bool | None = None) -> KillableRedis:
        persistent = self.persistent if persistent is None else persistent
        self.workdir.mkdir(parents=True, exist_ok=True)
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
        self._proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", *aof, "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.5).ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on {self.port}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, no save."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def wipe(self) -> None:
        """Forget the persisted data (the next start comes back empty)."""
        for path in self.workdir.glob("appendonly*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    def __enter__(self) -> KillableRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
