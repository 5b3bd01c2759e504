"""Admission control at the door: a request body over `settings.max_body_bytes` is refused with 413 as soon as that
many bytes have arrived (or at once, when its Content-Length says so), before any parsing, so one huge body cannot
hold the gateway's event loop or memory. A request without a valid API key (api/door.py authenticates before this
runs) gets `max_anonymous_body_bytes` instead; a body that has not fully arrived `body_read_timeout_seconds` after the
request began is refused with 408, so a client trickling its body (or sending none) cannot hold its connection and
memory forever. The other limits live where their facts are: tokens per request and datums
in the service layer (service/training.py), queue quotas in the producer's script (queue/producer.py), the
adapter quota in service/adapters.py.

A chain step refused here has taken its seq_id on the client; when the request names it in the `X-Seq-Id` header
(our client always does: the body is not read, so its seq_id is unknown), the rejection is queued in its place like
any other (service/rejections.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.api.deps import AUTH_DEFERRED, AUTHENTICATED_TENANT
from loraplex.errors import InvalidRequestError, LoraplexError, RequestTooLargeError

SEQ_ID_HEADER = "X-Seq-Id"
ANONYMOUS_SETTING = "LORAPLEX_MAX_ANONYMOUS_BODY_BYTES"


class BodyRefused(HTTPException):
    """A body refused while it was being read (api/errors.py answers it, with Connection: close). `error_type` is the
    typed error it stands for, in the JSON answer and in a refused chain step's stored result."""

    error_type: type[LoraplexError] = InvalidRequestError


class BodyTooLarge(BodyRefused):
    error_type = RequestTooLargeError

    def __init__(self, limit: int, setting: str = "LORAPLEX_MAX_BODY_BYTES", whose: str = "") -> None:
        super().__init__(413, f"request body over the gateway's limit of {limit} bytes{whose} ({setting})")


class BodyReadTimeout(BodyRefused):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408, f"the request body did not arrive within {timeout_s:g} s (LORAPLEX_BODY_READ_TIMEOUT_SECONDS)"
        )


class BodyLimit:
    """ASGI middleware: raise BodyTooLarge from `receive` once more than the request's limit of body bytes arrive
    (`limit` with a valid API key, `anonymous_limit` without), BodyReadTimeout once the body is not complete
    `read_timeout_s` after the request began. Raised inside the route's body read, so FastAPI's exception handlers
    (and the route's identity) apply. Reads after the body's last part (a long-poll watching for a disconnect) are
    not timed."""

    def __init__(self, app: ASGIApp, limit: int, anonymous_limit: int, read_timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.anonymous_limit = anonymous_limit
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get(AUTHENTICATED_TENANT) is not None or scope.get(AUTH_DEFERRED):
            limit, setting, whose = self.limit, "LORAPLEX_MAX_BODY_BYTES", ""
        else:
            limit, setting, whose = self.anonymous_limit, ANONYMOUS_SETTING, " for a request without a valid API key"
        declared = _content_length(scope)
        deadline = time.monotonic() + self.read_timeout_s
        seen = 0
        complete = False

        async def limited() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            if declared is not None and declared > limit:
                raise BodyTooLarge(limit, setting, whose)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BodyReadTimeout(self.read_timeout_s)
            try:
                # a timeout scope, not wait_for: wait_for ran receive() as a task of its own, two more turns of the
                # event loop per body read
                async with asyncio.timeout(remaining):
                    message = await receive()
            except TimeoutError:
                raise BodyReadTimeout(self.read_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit, setting, whose)
                complete = not message.get("more_body", False)
            else:  # the client went away: nothing more to time
                complete = True
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
