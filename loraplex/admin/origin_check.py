"""CSRF defence for the admin, beside its SameSite=strict session cookie (which a browser never sends on a request
another site starts): a state-changing request (POST, PUT, PATCH, DELETE) whose Origin (or, without one, Referer)
names another host than the request's own is refused with 403 before the admin sees it."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


class SameOriginOnly:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            source = headers.get("origin") or headers.get("referer")
            if source and urlsplit(source).netloc != headers.get("host", ""):
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"cross-site request refused"})
                return
        await self.app(scope, receive, send)
