"""`stream: true` as the tokens come: the call's sample requests were queued with `stream_partials`, so the pool
publishes each one's tokens so far after every sampling slice (queue/sample_partials.py); this reads those entries
and the results and sends Server-Sent Events (stream_state.py makes the chunks).

- Before the first byte: the route waits, as a non-streaming call does, until something is there to send (a piece of
  text or a result) or `openai_wait_seconds` pass. So a sample that fails at once (a bad token id) or never starts
  answers its HTTP status (400, 408 naming the request ids...), never a 200 that carries only an error.
- Then the body (`sse_body`, an async generator): one poll at a time in a worker thread, each blocking at most
  POLL_S (on the partial streams while a sample goes on; on the result once its end entry came), chunks sent as they
  come, a `: keep-alive` comment after KEEPALIVE_S without one, the usage chunk and `data: [DONE]` at the end. A
  failure after the first byte is an `{"error": ...}` event (OpenAI's shape; the official client raises it), and
  `openai_wait_seconds` with nothing new ends the stream with a 408-shaped one.
- A client that goes away: the server cancels the body at its next await (a poll at most), and `SseResponse` gives the
  long-poll slot back (also for a body never started); the samples finish on the pool (their results are at GET /v1/futures/<id> until their TTL) and their partial
  streams expire (END_TTL_S after the end entry). A stream that ends normally deletes its partial streams."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import redis
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.api.openai.errors import error_body
from loraplex.api.openai.responses import SSE_DONE, sse_event
from loraplex.api.openai.stream_state import Chunk, StreamState
from loraplex.errors import LoraplexError, WaitTimeoutError, http_status_for
from loraplex.protocol import Outcome
from loraplex.queue.results import ResultStore
from loraplex.queue.sample_partials import PartialReader

log = logging.getLogger(__name__)

POLL_S = 0.25  # one poll's longest wait: also how long a client's going away may go unnoticed
KEEPALIVE_S = 10.0
KEEPALIVE = b": keep-alive\n\n"


class SampleStream:
    """The partial entries and results of one call's sample requests, read a poll at a time."""

    def __init__(
        self, results: ResultStore, request_ids: Sequence[str], state: StreamState, idle_s: float,
        prompt_tokens: int, include_usage: bool,
    ) -> None:  # fmt: skip
        self.results = results
        self.reader = PartialReader(results.wait_redis)
        self.request_ids = list(request_ids)
        self.state = state
        self.idle_s = idle_s
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.after = {rid: "0" for rid in request_ids}  # the last entry read of each partial stream
        self.ended: set[str] = set()  # requests whose end entry came: their results are about to land
        self.pending = list(request_ids)  # requests without their result yet
        self._last_news = time.monotonic()

    @property
    def done(self) -> bool:
        return not self.pending

    def first(self) -> list[Chunk]:
        """The chunks that open the stream, once there is something to send (or every request is done); raises the
        failure of a sample that failed, or WaitTimeoutError after `idle_s` with nothing."""
        chunks = self.state.opening()
        while not self.done:
            news = self.poll(POLL_S)
            if news:
                return chunks + news
        return chunks

    def poll(self, block_s: float) -> list[Chunk]:
        """The chunks that arrived, waiting up to `block_s` while there are none."""
        chunks: list[Chunk] = []
        news = False
        for rid in list(self.pending):
            outcome = self.results.get(rid)
            if outcome is not None:
                chunks += self._finish(rid, outcome)
                news = True
        live = {rid: self.after[rid] for rid in self.pending if rid not in self.ended}
        if live:
            for rid, entry_id, entry in self.reader.read(live, None if news else block_s):
                self.after[rid] = entry_id
                news = True
                if entry.end:
                    self.ended.add(rid)
                if rid in self.pending:
                    chunks += self.state.partial(rid, entry)
        elif self.pending and not news:  # every sample left has ended: wait for the first one's result
            outcome = self.results.wait(self.pending[0], block_s)
            if outcome is not None:
                chunks += self._finish(self.pending[0], outcome)
                news = True
        now = time.monotonic()
        if news:
            self._last_news = now
        elif now - self._last_news > self.idle_s:
            raise WaitTimeoutError(
                f"nothing new from the samples for {self.idle_s:g} s; they stay queued (requests "
                f"{', '.join(self.pending)}: their results are at GET /v1/futures/<id>)"
            )
        return chunks

    def closing(self) -> list[Chunk]:
        return self.state.closing(self.prompt_tokens, self.include_usage)

    def close(self) -> None:
        """Delete the partial streams (the results are in)."""
        self.reader.delete(self.request_ids)

    def _finish(self, rid: str, outcome: Outcome) -> list[Chunk]:
        self.pending.remove(rid)
        if not outcome.ok:
            raise outcome.exception("sampling failed")
        return self.state.result(rid, {} if outcome.result is None else outcome.result.to_wire())


class SseResponse(StreamingResponse):
    """The event stream, giving the long-poll slot back (`release`, once) however it ends: the body's end, a client
    that left (the server cancels the body), or a body never started (a client gone before the first byte)."""

    def __init__(self, first: list[Chunk], stream: SampleStream, release: Callable[[], object]) -> None:
        self._release = _once(release)
        super().__init__(sse_body(first, stream, self._release), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _once(action: Callable[[], object]) -> Callable[[], None]:
    done = threading.Lock()

    def run() -> None:
        if done.acquire(blocking=False):
            action()

    return run


async def sse_body(first: list[Chunk], stream: SampleStream, release: Callable[[], object]) -> AsyncIterator[bytes]:
    """The response body after the first chunks (see the module doc); `release` gives the long-poll slot back."""
    try:
        for chunk in first:
            yield sse_event(chunk)
        quiet_since = time.monotonic()
        while not stream.done:
            chunks = await anyio.to_thread.run_sync(stream.poll, POLL_S)
            for chunk in chunks:
                yield sse_event(chunk)
            now = time.monotonic()
            if chunks:
                quiet_since = now
            elif now - quiet_since >= KEEPALIVE_S:
                yield KEEPALIVE
                quiet_since = now
        for chunk in stream.closing():
            yield sse_event(chunk)
        yield SSE_DONE
        await anyio.to_thread.run_sync(stream.close)
    except LoraplexError as exc:
        yield sse_event(error_body(http_status_for(exc), exc.message))
    except redis.RedisError as exc:
        log.warning("a stream lost Redis (%s: %s)", type(exc).__name__, exc)
        yield sse_event(error_body(503, "the service's queue (Redis) is unavailable; retry shortly"))
    except Exception:
        log.exception("a stream failed")
        yield sse_event(error_body(500, "the stream failed on the server"))
    finally:
        release()
