"""The OpenAI routes' body bound: a body longer than any acceptable call (its prompts are bounded in bytes, its token
lists by the sample work) is a 413 before it is parsed, so a 31 MB prompt costs the gateway a read, not a JSON parse,
a validation and copies of 31 MB in the event loop every tenant's calls share."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response

from loraplex.api.json_body import JsonBodyRoute
from loraplex.errors import RequestTooLargeError
from loraplex.settings import Settings

# Room for the JSON around the text: escapes, token lists (at most the sample work's tokens, ~12 bytes each), fields.
BODY_BYTES_PER_PROMPT_BYTE = 4
BODY_SLACK_BYTES = 2**20


def openai_body_limit(settings: Settings) -> int:
    """The longest body an acceptable OpenAI call can have, derived from LORAPLEX_MAX_PROMPT_BYTES_PER_REQUEST."""
    return BODY_BYTES_PER_PROMPT_BYTE * settings.resolved_max_prompt_bytes_per_request + BODY_SLACK_BYTES


class BoundedBodyRoute(JsonBodyRoute):
    """A route whose body is read with the bound above: past it the rest is read and dropped (a client still sending
    would see a reset connection, not the 413) and nothing is parsed; a body within it is parsed as every route's
    is (api/json_body.py)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            limit = openai_body_limit(request.app.state.services.settings)
            chunks: list[bytes] = []
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif chunks:
                    chunks.clear()  # dropped as it comes: the refused body is never held whole
            if size > limit:
                _refuse(limit)
            request._body = b"".join(chunks)  # what FastAPI's handler reads (Request caches its body here)
            return await handler(request)

        return bounded


def _refuse(limit: int) -> None:
    raise RequestTooLargeError(
        f"the request body is over {limit} bytes: more than a call within LORAPLEX_MAX_PROMPT_BYTES_PER_REQUEST can need"
    )
