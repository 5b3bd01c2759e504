"""HTTP to the gateway, sync and async, with HTTP errors turned into the typed errors of loraplex.errors."""

from __future__ import annotations

from typing import Any, BinaryIO

import httpx

from loraplex.errors import (
    AuthenticationError,
    CapacityError,
    ConflictError,
    InvalidRequestError,
    LoraplexError,
    NotFoundError,
)

ERROR_BY_STATUS: dict[int, type[LoraplexError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    422: InvalidRequestError,
    429: CapacityError,
}


def raise_for_status(response: httpx.Response) -> Any:
    if response.is_success:
        return response.json()
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    detail = body.get("detail", body)
    if isinstance(detail, list):  # FastAPI validation errors: name each bad field
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in detail)
    cls = ERROR_BY_STATUS.get(response.status_code, LoraplexError)
    raise cls(f"HTTP {response.status_code}: {detail}")


class Transport:
    def __init__(self, base_url: str, api_key: str, timeout: float = 120.0) -> None:
        headers = {"X-API-Key": api_key}
        self._sync = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self._async: httpx.AsyncClient | None = None
        self._base_url, self._headers, self._timeout = base_url, headers, timeout

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return raise_for_status(self._sync.request(method, path, **kwargs))

    def download(self, path: str, sink: BinaryIO, **kwargs: Any) -> httpx.Headers:
        """GET `path` and stream the body into `sink` (a binary file); an error status raises like `request`."""
        with self._sync.stream("GET", path, **kwargs) as response:
            if not response.is_success:
                response.read()
                raise_for_status(response)
            for chunk in response.iter_bytes():
                sink.write(chunk)
            return response.headers

    async def request_async(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._async is None:
            self._async = httpx.AsyncClient(base_url=self._base_url, headers=self._headers, timeout=self._timeout)
        return raise_for_status(await self._async.request(method, path, **kwargs))

    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
