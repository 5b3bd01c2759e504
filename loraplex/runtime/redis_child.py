"""A private `redis-server` child process (for `serve --embedded`, the demo and the tests): loopback only, stopped with
SHUTDOWN NOSAVE and reaped. Under the embedded stack's supervisor (supervisor.py) it is restarted when it dies: the
same port, the same folder, so the new server loads the append-only file the dead one wrote.

Persistence: an append-only file in its folder (`appendonly yes`, no RDB snapshots), so a redis-server killed and
started again on the same folder has every queued request, result, idempotency key and request log back
(DESIGN, Durability). `appendfsync always` by default: redis writes and fsyncs each change before it answers, so
neither a killed redis-server nor a machine crash loses anything it answered. `everysec` does not hold that even for
a killed process: while the once-a-second background fsync is still running, redis 7 postpones its writes (up to 2
s) yet answers the commands, so a SIGKILL then loses answered writes (seen with a slowed fsync: thousands of
answered INCRs gone). `no` writes before each answer (a killed process loses nothing) but leaves the flush to the
kernel (a machine crash loses up to ~30 s). `persist=False`: no persistence at all (a cache-like test server)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from loraplex.runtime.netutil import free_port
from loraplex.runtime.supervisor import die_with_parent

log = logging.getLogger("loraplex.runtime.redis_child")

INSTALL_HINT = "redis-server is not installed: run `apt-get install -y redis-server` (make demo/test do it as root)"


class RedisChild:
    """`start` (waits until it answers PING), `stop`, `kill` (a crash, for fault tests); and what the supervisor
    needs (`proc`, `alive`, `kill_group`, `respawn`: supervisor.Supervised)."""

    name = "redis"

    def __init__(
        self, port: int | None = None, workdir: Path | None = None, *, persist: bool = True, appendfsync: str = "always"
    ) -> None:
        self._fixed_port = port is not None
        self.persist = persist
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="loraplex-redis-"))
        self._proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisChild:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A free port can be taken between our probe and the server's bind: try a few when we picked it.
        for _ in range(1 if self._fixed_port else 5):
            if self._launch(binary, timeout_s):
                return self
            self.port = free_port()
        server_log = self.workdir / "redis.log"
        raise RuntimeError(
            f"redis-server did not start: {server_log.read_text()[-2000:] if server_log.exists() else ''}"
        )

    def _launch(self, binary: str, timeout_s: float) -> bool:
        self._spawn(binary)
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._proc.poll() is None:
            if self.ping():
                return True
            time.sleep(0.02)
        self._reap()
        return False

    def _spawn(self, binary: str) -> None:
        # A direct child (not daemonized) so that we reap it: nothing is left behind, not even a zombie. Its own
        # session (and process group) keeps a terminal's Ctrl-C from killing it before the processes that use it have
        # stopped, and holds an append-only-file rewrite child with it for kill_group.
        persistence = (
            ["--appendonly", "yes", "--appendfsync", self.appendfsync] if self.persist else ["--appendonly", "no"]
        )
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
             "--daemonize", "no", "--logfile", str(self.workdir / "redis.log"), "--dir", str(self.workdir)],
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill_group(self) -> None:
        """SIGKILL what is left of the server's process group (a rewrite child of a dead server), and reap it; the
        `proc` stays, with its exit code, until `respawn` replaces it."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()

    def respawn(self) -> None:
        """The supervisor's restart: a new redis-server on the same port and folder, which loads the append-only file
        before it answers (the gateway and the pool retry meanwhile). Not waited for: one that cannot start exits and
        is restarted with the supervisor's backoff (redis.log in the folder says why)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        log.warning("redis-server restarting on port %s from its append-only file in %s", self.port, self.workdir)
        self._spawn(binary)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _reap(self) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (fault tests), keeping its folder; `stop` is the clean way."""
        if self._proc is not None:
            self._proc.kill()
            self._reap()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.sendall(b"SHUTDOWN NOSAVE\r\n")
                    s.recv(16)  # the server closes the connection as it exits
            except OSError:
                self._proc.terminate()
        self._reap()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisChild:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
