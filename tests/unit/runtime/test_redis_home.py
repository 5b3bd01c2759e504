"""The embedded stack's Redis port, remembered per home folder: the same port at every start while it is free, a new
one (remembered from then on) when something else took it."""

from __future__ import annotations

import socket
from pathlib import Path

from loraplex.runtime.redis_home import embedded_redis_port, port_file, remembered_port, remembered_url


def test_the_first_port_is_remembered_and_reused(tmp_path: Path) -> None:
    assert remembered_url(tmp_path) is None
    port = embedded_redis_port(tmp_path)
    assert remembered_port(tmp_path) == port and embedded_redis_port(tmp_path) == port
    assert remembered_url(tmp_path) == f"redis://127.0.0.1:{port}/0"


def test_a_taken_port_is_replaced_and_the_new_one_remembered(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port_file(tmp_path).parent.mkdir(parents=True)
        port_file(tmp_path).write_text(f"{taken.getsockname()[1]}\n")
        port = embedded_redis_port(tmp_path)
        assert port != taken.getsockname()[1] and remembered_port(tmp_path) == port


def test_a_file_that_is_not_a_port_is_ignored(tmp_path: Path) -> None:
    port_file(tmp_path).parent.mkdir(parents=True)
    port_file(tmp_path).write_text("not a port\n")
    assert remembered_port(tmp_path) is None
    assert embedded_redis_port(tmp_path) == remembered_port(tmp_path)
