"""The one place where typed errors become HTTP status codes."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loraplex.errors import (
    AuthenticationError,
    CapacityError,
    ConflictError,
    InvalidRequestError,
    LoraplexError,
    NotFoundError,
)

STATUS_BY_ERROR: dict[type[LoraplexError], int] = {
    AuthenticationError: 401,
    NotFoundError: 404,
    ConflictError: 409,
    InvalidRequestError: 400,
    CapacityError: 429,
}


def status_for(exc: LoraplexError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return 500


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoraplexError)
    async def _typed(_: Request, exc: LoraplexError) -> JSONResponse:
        status = status_for(exc)
        headers = {"WWW-Authenticate": "X-API-Key"} if status == 401 else None
        return JSONResponse(
            status_code=status,
            content={"detail": exc.message, "type": type(exc).__name__, "category": exc.category},
            headers=headers,
        )
