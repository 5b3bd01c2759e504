"""OpenAI's error shape for the OpenAI-compatible paths: `{"error": {"message", "type", "param", "code"}}`, with the
gateway's status codes (api/errors.py renders every typed error of these paths through `openai_error`).

    400 invalid_request_error  invalid_request | unsupported_parameter (a field this sampler cannot honour)
    401 invalid_request_error  invalid_api_key          404 invalid_request_error  model_not_found
    408 invalid_request_error  request_timeout          409 invalid_request_error  conflict (an Idempotency-Key reused)
    413 invalid_request_error  request_too_large        429 rate_limit_error       rate_limit_exceeded
    503 server_error           service_unavailable      500 server_error           internal_error (the pool failed)"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from loraplex.errors import LoraplexError, NotSupportedError

OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})

_KINDS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
}


def is_openai_path(path: str) -> bool:
    return path.rstrip("/") in OPENAI_PATHS


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind, default_code = _KINDS.get(status, ("invalid_request_error", "invalid_request") if status < 500
                                    else ("server_error", "internal_error"))  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


def openai_error(
    status: int, message: str, headers: dict[str, str] | None = None, *, param: str | None = None,
    exc: LoraplexError | None = None,
) -> JSONResponse:  # fmt: skip
    code = "unsupported_parameter" if isinstance(exc, NotSupportedError) else None
    return JSONResponse(
        status_code=status, content=error_body(status, message, param=param, code=code), headers=headers
    )
