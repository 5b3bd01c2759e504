"""A throwaway redis-server for tests: `with redis_server() as url: r = redis.Redis.from_url(url)`.

No persistence (`--save ''`, no AOF), bound to 127.0.0.1 on a free port, daemonized with its pid/log files in a
temporary folder; stopped with `SHUTDOWN NOSAVE` and the folder deleted afterwards."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start(port: int, directory: Path) -> bool:
    args = [
        REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--daemonize", "yes", "--pidfile", str(directory / "redis.pid"), "--logfile", str(directory / "redis.log"),
        "--dir", str(directory),
    ]  # fmt: skip
    if subprocess.run(args, capture_output=True, timeout=30).returncode != 0:
        return False
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if _ping(port):
            return True
        time.sleep(0.01)
    return False


def stop_redis(port: int) -> None:
    subprocess.run([REDIS_CLI, "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=30)


@contextmanager
def redis_server() -> Iterator[str]:
    """Start redis-server on a free port, yield its URL (`redis://127.0.0.1:PORT/0`), shut it down on exit."""
    if shutil.which(REDIS_SERVER) is None:
        raise RuntimeError("redis-server not found: apt-get install -y redis-server")
    directory = Path(tempfile.mkdtemp(prefix="loraplex-redis-"))
    port = None
    try:
        # A free port can be taken between our probe and the server's bind: retry a few times.
        for _ in range(5):
            candidate = _free_port()
            if _start(candidate, directory):
                port = candidate
                break
            stop_redis(candidate)
        if port is None:
            log = directory / "redis.log"
            raise RuntimeError(f"redis-server did not start; log:\n{log.read_text()[-4000:] if log.exists() else ''}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if port is not None:
            stop_redis(port)
        shutil.rmtree(directory, ignore_errors=True)
