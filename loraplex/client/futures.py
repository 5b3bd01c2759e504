"""A queued request's result: `.result()` blocks, `await future` waits without blocking the event loop.

Both wait at most the client's `result_timeout` (ServiceClient(result_timeout=...), default DEFAULT_RESULT_TIMEOUT_S,
15 minutes) unless given `timeout=` (None: wait forever), then raise FutureTimeoutError naming the request and the last
state and queue_state the server reported (e.g. "paused_capacity: pool default paused: no heartbeat for 40 s"). A 503
from the gateway while waiting (Redis or the database briefly away) is ridden out within that time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import Any, Final

from loraplex.client.transport import DEFAULT_RESULT_TIMEOUT_S, Transport
from loraplex.errors import FutureTimeoutError, RequestFailedError, ServiceUnavailableError, error_from_name

__all__ = ["DEFAULT", "DEFAULT_RESULT_TIMEOUT_S", "APIFuture"]

POLL_SECONDS = 20.0
UNAVAILABLE_RETRY_S = 1.0  # between polls while the gateway answers 503


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Final = _Default()  # `result(timeout=DEFAULT)`: the client's result_timeout


class APIFuture:
    def __init__(self, transport: Transport, request_id: str, model_id: str | None = None) -> None:
        self._transport = transport
        self.request_id = request_id
        self.model_id = model_id
        self._done: dict[str, Any] | None = None
        self.last_state = "queued"  # what the server last said, for the timeout error
        self.queue_state: str | None = None
        self.queue_state_reason: str | None = None
        transport.unsettled.add(self)  # another future's poll may bring this one's result (client/unsettled.py)

    def settle_from(self, body: dict[str, Any]) -> None:
        """The gateway answered this future finished (complete or failed) in another future's poll."""
        if self._done is None and body.get("state") in ("complete", "failed"):
            self._done = body

    def _settle(self, body: dict[str, Any]) -> bool:
        if body["state"] in ("complete", "failed"):
            self._done = body
            self._transport.unsettled.discard(self.request_id)
            return True
        self.last_state = str(body["state"])
        self.queue_state = body.get("queue_state")
        self.queue_state_reason = body.get("queue_state_reason")
        return False

    def _unavailable(self, exc: ServiceUnavailableError) -> None:
        self.last_state, self.queue_state, self.queue_state_reason = "unknown", "unavailable", exc.message

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

    def _params(self, wait: float) -> dict[str, Any]:
        """The poll's query: how long to wait, and the transport's other unsettled futures (their results may come
        back with this one's: client/unsettled.py)."""
        others = self._transport.unsettled.others(self.request_id)
        return {"timeout": wait, "also": ",".join(others)} if others else {"timeout": wait}

    def _poll(self, wait: float) -> dict[str, Any]:
        body = self._transport.request("GET", f"/v1/futures/{self.request_id}", params=self._params(wait))
        self._transport.unsettled.settle(body.get("also", ()))
        return body

    def _deadline(self, timeout: float | None | _Default) -> tuple[float | None, float | None]:
        limit = self._transport.result_timeout if isinstance(timeout, _Default) else timeout
        return limit, None if limit is None else time.monotonic() + limit

    @staticmethod
    def _left(deadline: float | None) -> float:
        return POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))

    def _timed_out(self, limit: float | None) -> FutureTimeoutError:
        queue = f", queue_state {self.queue_state}" if self.queue_state else ""
        reason = f": {self.queue_state_reason}" if self.queue_state_reason else ""
        return FutureTimeoutError(
            f"request {self.request_id} not finished after {limit:g} s (last state {self.last_state}{queue}{reason})",
            self.request_id,
            self.last_state,
            self.queue_state or "",
        )

    def result(self, timeout: float | None | _Default = DEFAULT) -> dict[str, Any]:
        """The result; waits up to `timeout` seconds (default: the client's result_timeout; None: forever), then
        raises FutureTimeoutError (a TimeoutError) naming the request and its last queue_state."""
        limit, deadline = self._deadline(timeout)
        while self._done is None:
            left = self._left(deadline)
            try:
                if self._settle(self._poll(left)):
                    break
            except ServiceUnavailableError as exc:
                self._unavailable(exc)
                time.sleep(min(UNAVAILABLE_RETRY_S, left))
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timed_out(limit)
        return self._value()

    async def result_async(self, timeout: float | None | _Default = DEFAULT) -> dict[str, Any]:
        limit, deadline = self._deadline(timeout)
        path = f"/v1/futures/{self.request_id}"
        while self._done is None:
            left = self._left(deadline)
            try:
                body = await self._transport.request_async("GET", path, params=self._params(left))
                self._transport.unsettled.settle(body.get("also", ()))
                if self._settle(body):
                    break
            except ServiceUnavailableError as exc:
                self._unavailable(exc)
                await asyncio.sleep(min(UNAVAILABLE_RETRY_S, left))
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timed_out(limit)
        return self._value()

    def __await__(self) -> Generator[Any, None, dict[str, Any]]:
        return self.result_async().__await__()
