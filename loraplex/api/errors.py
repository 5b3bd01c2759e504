"""The one place where typed errors become HTTP responses (their status codes: `loraplex.errors.HTTP_STATUS_BY_ERROR`).

A part the gateway needs being down (Redis: connection refused or timed out; the database: OperationalError) is a
503 with `Retry-After` and a JSON error of type ServiceUnavailableError, logged at most once a second (one line, no
traceback); redis-py and SQLAlchemy reconnect by themselves, so the next request after the part is back succeeds."""

from __future__ import annotations

import logging
import math
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from loraplex.errors import LoraplexError, ServiceUnavailableError, http_status_for
from loraplex.logutil import RateLimitedLog

log = logging.getLogger("loraplex.api")
RETRY_AFTER_S = 1  # what a 503 asks the caller to wait (seconds)


def json_safe(value: Any) -> Any:
    """`value` as plain JSON: non-finite floats as their names ("NaN", "Infinity"), anything else unknown as its str, so
    an error body can always be rendered (an invalid input is exactly what it quotes)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 body (loc, msg, type, input, ctx per error), rendered so that it cannot fail."""
        return JSONResponse(status_code=422, content={"detail": json_safe(list(exc.errors()))})

    outage_log = RateLimitedLog(log, every_s=1.0)

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        part = "redis" if isinstance(exc, redis.RedisError) else "the database"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        outage_log.warning("%s unavailable (%s: %s); answering 503 (%s %s)", part, type(exc).__name__, first_line,
                           request.method, request.url.path)  # fmt: skip
        return _typed_response(ServiceUnavailableError(f"{part} is unavailable; retry in {RETRY_AFTER_S} s"))

    for outage in (redis.ConnectionError, redis.TimeoutError, OperationalError):
        app.add_exception_handler(outage, _unavailable)

    @app.exception_handler(LoraplexError)
    async def _typed(_: Request, exc: LoraplexError) -> JSONResponse:
        return _typed_response(exc)


def _typed_response(exc: LoraplexError) -> JSONResponse:
    status = http_status_for(exc)
    headers = {"WWW-Authenticate": "X-API-Key"} if status == 401 else None
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(
        status_code=status,
        content={"detail": exc.message, "type": type(exc).__name__, "category": exc.category},
        headers=headers,
    )

