"""`ServiceClient.close()` / `aclose()` close the async HTTP client too, on the event loop that opened it, so no
connection is left open. A real HTTP server (stdlib, keep-alive) answers the training calls."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from loraplex.client import ServiceClient, TrainingClient
from loraplex.client import transport as transport_module


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client pools the connection

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"request_id": "r1", "model_id": "m"}).encode()
        self.send_response(202)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(autouse=True)
def _collect_earlier_garbage() -> None:
    """Sockets other tests left unclosed warn when they are collected: collect them before a test records warnings,
    so it only sees its own."""
    gc.collect()


@pytest.fixture()
def base_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def opened(monkeypatch: pytest.MonkeyPatch) -> list[httpx.AsyncClient]:
    """Every async HTTP client the transport opens."""
    clients: list[httpx.AsyncClient] = []

    class Recorded(httpx.AsyncClient):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            clients.append(self)

    monkeypatch.setattr(transport_module.httpx, "AsyncClient", Recorded)
    return clients


async def _train(client: ServiceClient) -> None:
    future = await TrainingClient(client._transport, "m").forward_async([{"model_input": [1, 2]}])
    assert future.request_id == "r1"


def _no_resource_warnings(caught: list[warnings.WarningMessage]) -> None:
    gc.collect()  # an unclosed socket warns when it is collected
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]


def test_sync_close_closes_the_async_client_on_its_idle_loop(base_url, opened) -> None:
    loop = asyncio.new_event_loop()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client = ServiceClient(base_url, api_key="tml-test")
            loop.run_until_complete(_train(client))
            assert len(opened) == 1 and not opened[0].is_closed
            client.close()
            assert opened[0].is_closed
            _no_resource_warnings(caught)
    finally:
        loop.close()


def test_async_with_closes_the_async_client(base_url, opened) -> None:
    async def main() -> None:
        async with ServiceClient(base_url, api_key="tml-test") as client:
            await _train(client)
            assert not opened[0].is_closed
        assert opened[0].is_closed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        _no_resource_warnings(caught)


def test_sync_close_inside_the_loop_closes_it_at_the_next_await(base_url, opened) -> None:
    async def main() -> None:
        with ServiceClient(base_url, api_key="tml-test") as client:  # a plain `with` in async code
            await _train(client)
        await asyncio.sleep(0.05)
        assert opened[0].is_closed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        _no_resource_warnings(caught)


def test_closing_after_the_loop_ended_warns_rather_than_leaking_silently(base_url, opened) -> None:
    client = ServiceClient(base_url, api_key="tml-test")
    asyncio.run(_train(client))  # the loop that owns the pooled connection is gone after this
    with pytest.warns(ResourceWarning, match="aclose"):
        client.close()
    assert opened[0].is_closed


def test_close_without_async_calls_opens_nothing(base_url, opened) -> None:
    client = ServiceClient(base_url, api_key="tml-test")
    client.close()
    assert opened == []
