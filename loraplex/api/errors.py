"""The one place where typed errors become HTTP responses (their status codes: `loraplex.errors.HTTP_STATUS_BY_ERROR`)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from loraplex.errors import LoraplexError, http_status_for


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

    @app.exception_handler(LoraplexError)
    async def _typed(_: Request, exc: LoraplexError) -> JSONResponse:
        status = http_status_for(exc)
        headers = {"WWW-Authenticate": "X-API-Key"} if status == 401 else None
        return JSONResponse(
            status_code=status,
            content={"detail": exc.message, "type": type(exc).__name__, "category": exc.category},
            headers=headers,
        )
