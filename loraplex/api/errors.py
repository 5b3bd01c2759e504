"""The one place where typed errors become HTTP responses (their status codes: `loraplex.errors.HTTP_STATUS_BY_ERROR`).

A part the gateway needs being down (Redis: connection refused or timed out; the database: OperationalError) is a
503 with `Retry-After` and a JSON error of type ServiceUnavailableError, logged at most once a second (one line, no
traceback); redis-py and SQLAlchemy reconnect by themselves, so the next request after the part is back succeeds.

The OpenAI-compatible paths (api/openai/: /v1/completions, /v1/chat/completions, /v1/models) answer every error,
a failed validation included (400 there, as OpenAI does, not 422), in OpenAI's shape (api/openai/errors.py) with the
same status codes and headers."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.concurrency import run_in_threadpool

from loraplex.api.admission import BodyRefused, seq_id_header
from loraplex.api.deps import key_of_request, tenant_for_key
from loraplex.api.openai.errors import is_openai_path, openai_error
from loraplex.api.routes.chain import seq_step_kind
from loraplex.errors import (
    CapacityError,
    InvalidRequestError,
    LoraplexError,
    ServiceUnavailableError,
    error_name,
    http_status_for,
)
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.runtime.utf8 import utf8_safe
from loraplex.service.rejections import fill_rejected

log = logging.getLogger("loraplex.api")
RETRY_AFTER_S = 1  # what a 503 asks the caller to wait (seconds)
TINKER_PREFIX = "/api/v1/"  # the Tinker routes (api/tinker/)


def json_safe(value: Any) -> Any:
    """`value` as plain JSON: non-finite floats as their names ("NaN", "Infinity"), lone surrogates escaped, anything
    else unknown as its str, so an error body can always be rendered (an invalid input is exactly what it quotes)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    if isinstance(value, str):
        return utf8_safe(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dict):
        return {utf8_safe(str(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return utf8_safe(str(value))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 body (loc, msg, type, input, ctx per error), rendered so that it cannot fail. A chain step's
        seq_id is queued as rejected first (service/rejections.py), so the caller's next step does not wait."""
        errors = list(exc.errors())
        if is_openai_path(request.url.path):
            loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
            return openai_error(400, utf8_safe(validation_summary(errors)), param=loc[0] if loc else None)
        body = exc.body if isinstance(exc.body, dict) else {}
        await _fill_rejected_step(
            request, body.get("seq_id"), InvalidRequestError, validation_summary(errors), body.get("model_id")
        )
        return JSONResponse(status_code=422, content={"detail": json_safe(errors)})

    @app.exception_handler(BodyRefused)
    async def _body_refused(request: Request, exc: BodyRefused) -> JSONResponse:
        """413 (too large) or 408 (too slow) before the body was parsed: the seq_id, if any, comes from the X-Seq-Id
        header."""
        if is_openai_path(request.url.path):
            return openai_error(exc.status_code, exc.detail, {"Connection": "close"})
        await _fill_rejected_step(request, seq_id_header(request.headers), exc.error_type, exc.detail)
        content = {"detail": exc.detail, "type": error_name(exc.error_type), "category": "user"}
        # Connection: close, so the server stops reading the rest of the body rather than draining it for keep-alive.
        return JSONResponse(status_code=exc.status_code, content=content, headers={"Connection": "close"})

    outage_log = RateLimitedLog(log, every_s=1.0)

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        part = "redis" if isinstance(exc, redis.RedisError) else "the database"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        outage_log.warning("%s unavailable (%s: %s); answering 503 (%s %s)", part, type(exc).__name__, first_line,
                           request.method, request.url.path)  # fmt: skip
        error = ServiceUnavailableError(f"{part} is unavailable; retry in {RETRY_AFTER_S} s")
        return _typed_response(error, openai=is_openai_path(request.url.path))

    for outage in (redis.ConnectionError, redis.TimeoutError, OperationalError):
        app.add_exception_handler(outage, _unavailable)

    @app.exception_handler(DataError)
    async def _unstorable(request: Request, exc: DataError) -> JSONResponse:
        """A value the database refuses to hold or compare (PostgreSQL: a NUL character in a text, an integer past
        bigint) came from the request: a 400 naming the database's reason. The transaction rolled back."""
        reason = (str(exc.orig).strip().splitlines() or ["invalid value"])[0][:200]
        error = InvalidRequestError(f"the request holds a value the database cannot store: {reason}")
        path = request.url.path
        return _typed_response(error, tinker=path.startswith(TINKER_PREFIX), openai=is_openai_path(path))

    @app.exception_handler(LoraplexError)
    async def _typed(request: Request, exc: LoraplexError) -> JSONResponse:
        path = request.url.path
        return _typed_response(exc, tinker=path.startswith(TINKER_PREFIX), openai=is_openai_path(path))


def typed_error_response(exc: LoraplexError, path: str) -> JSONResponse:
    """The answer to a typed error raised outside any route (api/door.py's 401), shaped for the path's API."""
    return _typed_response(exc, tinker=path.startswith(TINKER_PREFIX), openai=is_openai_path(path))


def _typed_response(exc: LoraplexError, tinker: bool = False, openai: bool = False) -> JSONResponse:
    status = http_status_for(exc)
    if tinker and status == 409:
        status = 400  # the Tinker SDK retries a 409 for minutes; a clash does not go away by itself
    headers = {"WWW-Authenticate": "X-API-Key"} if status == 401 else None
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    elif isinstance(exc, CapacityError) and exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    if openai:
        return openai_error(status, utf8_safe(exc.message), headers, exc=exc)
    return JSONResponse(
        status_code=status,
        content={"detail": utf8_safe(exc.message), "type": type(exc).__name__, "category": exc.category},
        headers=headers,
    )


def validation_summary(errors: Sequence[Any]) -> str:
    """One line from FastAPI's validation errors: `field.path: message; ...` (the first few)."""
    parts = []
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


async def _fill_rejected_step(
    request: Request, seq_id: Any, error_type: type[LoraplexError], message: str, body_model_id: Any = None
) -> None:
    """For a chain step that names a usable seq_id: queue its rejection (best effort; the error goes out anyway).
    The adapter is the path's `model_id` (native routes) or the body's (Tinker routes)."""
    kind = seq_step_kind(request)
    model_id = request.path_params.get("model_id") or body_model_id
    key = key_of_request(request)
    if (
        kind is None
        or type(seq_id) is not int
        or not 0 <= seq_id < 2**31
        or not isinstance(model_id, str)
        or not model_id
        or key is None
    ):
        return
    try:
        services = request.app.state.services
        tenant = await tenant_for_key(services, key)
        await run_in_threadpool(fill_rejected, services, tenant, model_id, seq_id, kind, error_type, message)
    except Exception as exc:  # the caller's error matters more; its next step then waits for the gap timeout
        log.warning("could not queue the rejection of %s seq_id %s: %s", model_id, seq_id, exc)
