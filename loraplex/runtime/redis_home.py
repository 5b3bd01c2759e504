"""The embedded stack's Redis port, remembered in its home folder (HOME/redis/port): `serve --embedded` starts its
redis-server on the same port every time (while that port is free), so a process started by hand with the same
LORAPLEX_HOME and no LORAPLEX_REDIS_URL (a pipelines worker, launch/pipeline_worker.py) finds it."""

from __future__ import annotations

import socket
from pathlib import Path

from loraplex.runtime.fsutil import write_bytes_atomic
from loraplex.runtime.netutil import free_port


def port_file(home: Path) -> Path:
    return home / "redis" / "port"


def remembered_port(home: Path) -> int | None:
    """The port the home's embedded redis-server last used; None when there is none (or the file is not a port)."""
    try:
        text = port_file(home).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None


def remembered_url(home: Path) -> str | None:
    port = remembered_port(home)
    return f"redis://127.0.0.1:{port}/0" if port is not None else None


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR as servers bind: a port in TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def embedded_redis_port(home: Path) -> int:
    """The port for the home's embedded redis-server: the remembered one while it is free, else a new one, which is
    remembered from now on."""
    port = remembered_port(home)
    if port is None or not port_is_free(port):
        port = free_port()
        port_file(home).parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(port_file(home), f"{port}\n".encode())
    return port
