"""Admission control at the door: a request body over `settings.max_body_bytes` is refused with 413 as soon as that
many bytes have arrived (or at once, when its Content-Length says so), before any parsing, so one huge body cannot
hold the gateway's event loop or memory. The other limits live where their facts are: tokens per request and datums
in the service layer (api/service/training.py), queue quotas in the producer's script (queue/producer.py), the
adapter quota in api/service/adapters.py.

A chain step refused here has taken its seq_id on the client; when the request names it in the `X-Seq-Id` header
(our client always does: the body is not read, so its seq_id is unknown), the rejection is queued in its place like
any other (api/service/rejections.py)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SEQ_ID_HEADER = "X-Seq-Id"


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over the gateway's limit of {limit} bytes (LORAPLEX_MAX_BODY_BYTES)")


class BodyLimit:
    """ASGI middleware: raise BodyTooLarge from `receive` once more than `limit` body bytes arrive. Raised inside the
    route's body read, so FastAPI's exception handlers (and the route's identity) apply."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            if declared is not None and declared > self.limit:
                raise BodyTooLarge(self.limit)
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def seq_id_header(headers: Any) -> int | None:
    """The seq_id a request names in its X-Seq-Id header, if it is an integer (its range is checked by the caller)."""
    raw = headers.get(SEQ_ID_HEADER.lower())
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
