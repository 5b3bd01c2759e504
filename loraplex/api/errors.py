"""The one place where typed errors become HTTP responses (their status codes: `loraplex.errors.HTTP_STATUS_BY_ERROR`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loraplex.errors import LoraplexError, http_status_for


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LoraplexError)
    async def _typed(_: Request, exc: LoraplexError) -> JSONResponse:
        status = http_status_for(exc)
        headers = {"WWW-Authenticate": "X-API-Key"} if status == 401 else None
        return JSONResponse(
            status_code=status,
            content={"detail": exc.message, "type": type(exc).__name__, "category": exc.category},
            headers=headers,
        )
