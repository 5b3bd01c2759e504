"""Small pieces of riding through restarts, without services: the client sends a call again when the gateway went away
(connection refused or dropped) and gives up after its retry window; a lease holder is dead only when it is a process
of this host that no longer exists (a zombie, or another host's process, is not)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from loraplex.client import transport as transport_module
from loraplex.client.transport import Transport
from loraplex.pool.leadership import holder_is_dead


def _transport(handler, retry_wait_s: float = 5.0) -> Transport:
    t = Transport("http://gateway", "key", retry_wait_s=retry_wait_s)
    t._sync = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(handler))
    return t


def test_a_call_whose_gateway_went_away_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "GONE_RETRY_S", 0.01)
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json={"ok": True})

    assert _transport(handler).request("POST", "/v1/adapters/a/optim_step", json={}) == {"ok": True}
    assert calls == ["/v1/adapters/a/optim_step"] * 3


def test_a_gateway_that_stays_away_raises_after_the_retry_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "GONE_RETRY_S", 0.01)

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(httpx.ConnectError):
        _transport(handler, retry_wait_s=0.05).request("GET", "/v1/futures/x")


def test_a_lease_holder_is_dead_only_when_it_is_a_gone_process_of_this_host() -> None:
    host = socket.gethostname()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # exited and reaped: no such process now
    assert holder_is_dead(f"{host}:{done.pid}:abc123")
    assert not holder_is_dead(f"{host}:{os.getpid()}:abc123")  # this process
    assert not holder_is_dead(f"{host}:{os.getppid()}:abc123")  # alive
    assert not holder_is_dead(f"another-host-{host}:{done.pid}:abc123")  # can't tell: wait out the TTL
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: its parent may not know yet
        assert not holder_is_dead(f"{host}:{zombie.pid}:abc123")
    finally:
        zombie.wait()
