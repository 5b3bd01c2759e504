"""A chain step refused at the door because its tenant is suspended: its seq_id is filled with the refusal
(service/rejections.py), as the routes fill the refusals they make themselves, so that the tenant's clients, which took
the seq_id before they sent the step, go on after a resume instead of waiting for it until the gap timeout.

The door has read no body. The seq_id comes from the X-Seq-Id header (our client sends it), else from the body, read
here within the body limit and the read timeout: JSON (the native routes and the Tinker JSON ones; the Tinker routes
name the adapter there too) or the Tinker forward_backward's protobuf. Best effort: what cannot be read is not filled,
and the 403 goes out all the same."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope

from loraplex.api.admission import seq_id_header
from loraplex.api.tinker.codec import decode_forward_backward, decompress
from loraplex.errors import LoraplexError
from loraplex.protocol import RequestKind
from loraplex.service.context import Services, TenantRef
from loraplex.service.rejections import fill_rejected

log = logging.getLogger("loraplex.api")

SEQ_ID_LIMIT = 2**31


async def fill_refused_step(
    scope: Scope, receive: Receive, route: BaseRoute, services: Services, tenant: TenantRef, error: LoraplexError
) -> None:
    """Queue `error` in the place of the chain step this request is, if it is one and its seq_id can be read."""
    kind: RequestKind | None = getattr(getattr(route, "endpoint", None), "seq_step_kind", None)
    if kind is None:
        return
    _, child = route.matches(scope)
    model_id: Any = child.get("path_params", {}).get("model_id")
    headers = Headers(scope=scope)
    seq_id: Any = seq_id_header(headers)
    if seq_id is None or not model_id:
        settings = services.settings
        body = await _body(receive, settings.max_body_bytes, settings.body_read_timeout_seconds)
        named = _named_in_body(body, headers.get("content-encoding"), settings.max_body_bytes) if body else None
        if named is None:
            return
        model_id, seq_id = model_id or named[0], named[1] if seq_id is None else seq_id
    if not isinstance(model_id, str) or not model_id or type(seq_id) is not int or not 0 <= seq_id < SEQ_ID_LIMIT:
        return
    try:
        await run_in_threadpool(fill_rejected, services, tenant, model_id, seq_id, kind, type(error), error.message)
    except Exception as exc:  # noqa: BLE001 - the refusal matters more; the next step then waits for the gap timeout
        log.warning("could not queue the refusal of %s seq_id %s: %s", model_id, seq_id, exc)


async def _body(receive: Receive, limit: int, timeout_s: float) -> bytes | None:
    """The whole body, or None when it is over `limit` bytes, does not arrive within `timeout_s`, or the client left."""
    chunks: list[bytes] = []
    size = 0

    async def read() -> bytes | None:
        nonlocal size
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    try:
        async with asyncio.timeout(timeout_s):
            return await read()
    except TimeoutError:
        return None


def _named_in_body(body: bytes, content_encoding: str | None, limit: int) -> tuple[Any, Any] | None:
    """(model_id, seq_id) as the body names them: a JSON object's fields, else the Tinker protobuf's."""
    try:
        plain = decompress(body, content_encoding, limit)
        value = orjson.loads(plain)
    except orjson.JSONDecodeError:
        value = None
    except LoraplexError:
        return None
    if isinstance(value, dict):
        return value.get("model_id"), value.get("seq_id")
    try:
        decoded = decode_forward_backward(plain)
    except LoraplexError:
        return None
    return decoded.model_id, decoded.seq_id
