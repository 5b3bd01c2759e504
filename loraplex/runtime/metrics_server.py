"""A small HTTP server for a process's Prometheus metrics (the pool's: `LORAPLEX_POOL_METRICS_PORT`), in a daemon
thread: GET /metrics answers `render()`; with a token, only a request carrying `Authorization: Bearer <token>` (the
same `LORAPLEX_METRICS_TOKEN` as the gateways'). prometheus-client's own start_http_server takes no token and no
render hook, hence these few lines over the stdlib's WSGI server."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client.CONTENT_TYPE_LATEST (text 0.0.4)

log = logging.getLogger(__name__)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass  # a scrape every few seconds is not worth a log line


def token_ok(header: str | None, token: str) -> bool:
    """No token configured: open. Else the header must be `Bearer <token>` (compared in constant time)."""
    if not token:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def wsgi_app(render: Callable[[], bytes], token: str = "") -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]
        if not token_ok(environ.get("HTTP_AUTHORIZATION"), token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a metrics token is required (Authorization: Bearer ...)\n"]
        try:
            body = render()
        except Exception:  # noqa: BLE001 - a scrape must not take the server down
            log.exception("rendering the metrics failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"rendering the metrics failed\n"]
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer:
    def __init__(self, host: str, port: int, render: Callable[[], bytes], token: str = "") -> None:
        self._server = make_server(host, port, wsgi_app(render, token), _ThreadingServer, handler_class=_QuietHandler)
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
