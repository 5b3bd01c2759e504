"""A free local TCP port (stdlib only: the worker ranks use it for their process group, the embedded stack for its
children). Another process can take it between this call and its bind: callers that pick it retry."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
