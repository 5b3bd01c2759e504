"""A queued request's result: `.result()` blocks, `await future` waits without blocking the event loop.

A training call's future is returned while its request is still being sent (`Transport.send`): `request_id` waits
for the gateway's answer, and a refusal (the gateway's 4xx, as its typed error) raises from `result()`, `await` and
`request_id`. Before its first poll a future lets the submissions in flight land (up to SEND_GRACE_S), so the poll
names them too (client/unsettled.py): a forward_backward and the optim_step sent beside it come back in one answer.

Both wait at most the client's `result_timeout` (ServiceClient(result_timeout=...), default DEFAULT_RESULT_TIMEOUT_S,
15 minutes) unless given `timeout=` (None: wait forever), then raise FutureTimeoutError naming the request and the last
state and queue_state the server reported (e.g. "paused_capacity: pool default paused: no heartbeat for 40 s"). A 503
from the gateway while waiting (Redis or the database briefly away) is ridden out within that time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from concurrent.futures import Future
from typing import Any, Final

from loraplex.client.transport import DEFAULT_RESULT_TIMEOUT_S, Transport
from loraplex.errors import FutureTimeoutError, RequestFailedError, ServiceUnavailableError, error_from_name

__all__ = ["DEFAULT", "DEFAULT_RESULT_TIMEOUT_S", "APIFuture"]

POLL_SECONDS = 20.0
UNAVAILABLE_RETRY_S = 1.0  # between polls while the gateway answers 503
SEND_GRACE_S = 0.1  # how long a first poll waits for the submissions in flight (a POST takes milliseconds)


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Final = _Default()  # `result(timeout=DEFAULT)`: the client's result_timeout


class APIFuture:
    def __init__(self, transport: Transport, request_id: str | None, model_id: str | None = None) -> None:
        """The future of a queued request (`request_id`); `APIFuture.send` for one still to be sent."""
        self._transport = transport
        self._request_id = request_id
        self._sending: Future[Any] | None = None
        self.model_id = model_id
        self._done: dict[str, Any] | None = None
        self._polled = False
        self.last_state = "queued"  # what the server last said, for the timeout error
        self.queue_state: str | None = None
        self.queue_state_reason: str | None = None
        if request_id is not None:
            transport.unsettled.add(self)  # another future's poll may bring this one's result (client/unsettled.py)

    @classmethod
    def send(cls, transport: Transport, path: str, model_id: str, **kwargs: Any) -> APIFuture:
        """POST `path` on the transport's threads (`Transport.send`); the future of the request it queues, returned
        at once. Its request id is known (and the future among the transport's unsettled ones) before the
        submission counts as done."""
        future = cls(transport, None, model_id)
        future.last_state = "sending"
        future._sending = transport.send("POST", path, on_answer=future._queued, **kwargs)
        return future

    def _queued(self, ref: dict[str, Any]) -> None:
        """The gateway's answer to the submission: the queued request's reference."""
        self._request_id, self.model_id = ref["request_id"], ref.get("model_id", self.model_id)
        self.last_state = "queued"
        self._transport.unsettled.add(self)

    @property
    def request_id(self) -> str:
        """The request's id; a future still being sent waits for the gateway's answer (and raises its refusal)."""
        self._accepted(None)
        assert self._request_id is not None
        return self._request_id

    def _accepted(self, timeout: float | None) -> None:
        """Wait up to `timeout` s (None: as long as it takes) for the submission's answer: the request id, or the
        gateway's refusal raised. TimeoutError if it is still on its way."""
        if self._request_id is None:
            assert self._sending is not None
            self._sending.result(timeout)  # `_queued` ran before it counts as done

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
        """Finished (or refused: then `result()` raises at once); a future still being sent is not."""
        if self._done is not None:
            return True
        if self._request_id is None:
            assert self._sending is not None
            if not self._sending.done():
                return False
            if self._sending.exception() is not None:
                return True
        return self._settle(self._poll(0.0))

    def _params(self, wait: float) -> dict[str, Any]:
        """The poll's query: how long to wait, and the transport's other unsettled futures (their results may come
        back with this one's: client/unsettled.py); before the first poll, the submissions in flight land."""
        if not self._polled:
            self._polled = True
            self._transport.wait_for_sends(min(wait, SEND_GRACE_S))
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
        name = self._request_id or f"to {self.model_id} (not yet accepted by the gateway)"
        return FutureTimeoutError(
            f"request {name} not finished after {limit:g} s (last state {self.last_state}{queue}{reason})",
            self._request_id or "",
            self.last_state,
            self.queue_state or "",
        )

    def _wait_accepted(self, limit: float | None, deadline: float | None) -> None:
        """`_accepted` within the caller's deadline: FutureTimeoutError past it."""
        if self._request_id is None:
            assert self._sending is not None
            try:
                self._accepted(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if self._sending.done():
                    raise  # the submission's own error
                raise self._timed_out(limit) from None

    def result(self, timeout: float | None | _Default = DEFAULT) -> dict[str, Any]:
        """The result; waits up to `timeout` seconds (default: the client's result_timeout; None: forever), then
        raises FutureTimeoutError (a TimeoutError) naming the request and its last queue_state."""
        limit, deadline = self._deadline(timeout)
        self._wait_accepted(limit, deadline)
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
        if self._request_id is None:
            assert self._sending is not None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:  # shielded: a timeout here must not cancel the submission itself
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._sending)), left)
            except TimeoutError:
                if not self._sending.done():
                    raise self._timed_out(limit) from None
            self._accepted(0.0)
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
