"""A queued request's result: `.result()` blocks, `await future` waits without blocking the event loop."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from loraplex.client.transport import Transport
from loraplex.errors import RequestFailedError, error_from_name

POLL_SECONDS = 20.0


class APIFuture:
    def __init__(self, transport: Transport, request_id: str, model_id: str | None = None) -> None:
        self._transport = transport
        self.request_id = request_id
        self.model_id = model_id
        self._done: dict[str, Any] | None = None

    def _settle(self, body: dict[str, Any]) -> bool:
        if body["state"] in ("complete", "failed"):
            self._done = body
            return True
        return False

    def _value(self) -> dict[str, Any]:
        assert self._done is not None
        if self._done["state"] == "failed":
            err = self._done["error"]
            if err["category"] == "user":
                raise error_from_name(err["type"], err["message"])
            raise RequestFailedError(err["message"], err["type"], err["category"])
        return self._done["result"]

    def done(self) -> bool:
        return self._done is not None or self._settle(self._poll(0.0))

    def _poll(self, wait: float) -> dict[str, Any]:
        return self._transport.request("GET", f"/v1/futures/{self.request_id}", params={"timeout": wait})

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._done is None:
            left = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            if self._settle(self._poll(left)):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        return self._value()

    async def result_async(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._done is None:
            left = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            path = f"/v1/futures/{self.request_id}"
            if self._settle(await self._transport.request_async("GET", path, params={"timeout": left})):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        return self._value()

    def __await__(self) -> Generator[Any, None, dict[str, Any]]:
        return self.result_async().__await__()
