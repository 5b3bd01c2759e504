"""HTTP to the gateway, sync and async, with HTTP errors turned into the typed errors of loraplex.errors."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import IO, Any

import httpx

from loraplex.client.unsettled import UnsettledFutures
from loraplex.errors import error_class_for_status
from loraplex.runtime.json_read import parse_json

# A gateway that went away mid-call (killed, restarting): the call is sent again after a short wait, up to the
# transport's `retry_wait_s`. Safe because every call is idempotent: submissions by (model_id, seq_id), reads anyway.
# (A create_adapter whose answer was lost creates a second adapter on its retry; the first one stays the caller's.)
GATEWAY_GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectTimeout)
GONE_RETRY_S = 0.25

# How long a future's `result()` waits by default (client/futures.py): a cold pool's first steps and a long queue fit;
# a dead pool does not hang the caller forever.
DEFAULT_RESULT_TIMEOUT_S = 900.0

# Submissions in flight at once per transport (`send`): a closed loop's forward_backward and optim_step go together.
SEND_THREADS = 4


def raise_for_status(response: httpx.Response) -> Any:
    if response.is_success:
        return parse_json(response.content)  # a result's logprobs: ~5x faster than httpx's response.json()
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    detail = body.get("detail", body)
    if isinstance(detail, list):  # FastAPI validation errors: name each bad field
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in detail)
    raise error_class_for_status(response.status_code)(f"HTTP {response.status_code}: {detail}")


def retry_after(response: httpx.Response) -> float | None:
    """Seconds a 429 or 503 asks the caller to wait before sending the same request again (None: no Retry-After, so
    a retry of the same request cannot succeed on its own, e.g. the adapter quota)."""
    if response.status_code not in (429, 503):
        return None
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


class Transport:
    """A sync HTTP client, and an async one opened on the first async call. The async client's connections belong to
    the event loop that opened it, so it is closed on that loop: `aclose()` from async code, or `close()`, which runs
    or schedules the close there (see `close`).

    A 429 or 503 with Retry-After (a queue quota, or Redis or the database briefly away: the same request goes through
    once that passes) is sent again after that wait, for up to `retry_wait_s` in all; the request is idempotent (its
    seq_id), so nothing is applied twice, and its seq_id is never left unsent. So is a call whose gateway went away
    (connection refused or dropped: GATEWAY_GONE), e.g. while the embedded stack restarts it."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        timeout: float = 120.0,
        result_timeout: float | None = DEFAULT_RESULT_TIMEOUT_S,
        retry_wait_s: float = 600.0,
    ) -> None:
        """timeout: per HTTP call; result_timeout: how long a future's `result()` waits by default (None: forever);
        retry_wait_s: how long 429/503 answers with Retry-After are retried before they raise."""
        self.result_timeout = result_timeout
        self.retry_wait_s = retry_wait_s
        headers = {"X-API-Key": api_key}
        self._sync = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Task[None] | None = None  # a close that `close()` scheduled (loops hold tasks weakly)
        self._base_url, self._headers, self._timeout = base_url, headers, timeout
        self.unsettled = UnsettledFutures()  # this transport's futures not settled yet (client/unsettled.py)
        self._sender: ThreadPoolExecutor | None = None  # `send`'s threads, started on the first
        self._sending: set[Future[Any]] = set()
        self._sending_lock = threading.Lock()

    def send(
        self, method: str, path: str, on_answer: Callable[[Any], None] | None = None, **kwargs: Any
    ) -> Future[Any]:
        """`request` on one of SEND_THREADS background threads: the caller goes on while it is sent (its answer, or
        its typed error, comes from the returned Future; `on_answer` gets the answer first, on that thread). The
        threads are joined at `close()`, and at interpreter exit, so a call made is sent."""

        def call() -> Any:
            answer = self.request(method, path, **kwargs)
            if on_answer is not None:
                on_answer(answer)
            return answer

        with self._sending_lock:
            if self._sender is None:
                self._sender = ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="loraplex-send")
            sent = self._sender.submit(call)
            self._sending.add(sent)
        sent.add_done_callback(self._sent)
        return sent

    def _sent(self, sent: Future[Any]) -> None:
        with self._sending_lock:
            self._sending.discard(sent)

    def wait_for_sends(self, timeout: float) -> None:
        """Wait up to `timeout` s for the submissions in flight (so a poll can name their futures:
        client/unsettled.py)."""
        with self._sending_lock:
            sending = list(self._sending)
        if sending:
            wait_all(sending, timeout)

    def _send(self, method: str, path: str, deadline: float, **kwargs: Any) -> httpx.Response:
        while True:
            try:
                return self._sync.request(method, path, **kwargs)
            except GATEWAY_GONE:
                if time.monotonic() + GONE_RETRY_S > deadline:
                    raise
                time.sleep(GONE_RETRY_S)

    async def _send_async(self, client: httpx.AsyncClient, method: str, path: str, deadline: float,
                          **kwargs: Any) -> httpx.Response:  # fmt: skip
        while True:
            try:
                return await client.request(method, path, **kwargs)
            except GATEWAY_GONE:
                if time.monotonic() + GONE_RETRY_S > deadline:
                    raise
                await asyncio.sleep(GONE_RETRY_S)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.retry_wait_s
        while True:
            response = self._send(method, path, deadline, **kwargs)
            wait = retry_after(response)
            if wait is None or time.monotonic() + wait > deadline:
                return raise_for_status(response)
            time.sleep(wait)

    def get_response(self, path: str, **kwargs: Any) -> httpx.Response:
        """GET `path` and hand back the response whatever its status (for routes whose error bodies carry data)."""
        return self._send("GET", path, time.monotonic() + self.retry_wait_s, **kwargs)

    def download(self, path: str, sink: IO[bytes], **kwargs: Any) -> httpx.Headers:
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
            self._async_loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.retry_wait_s
        while True:
            response = await self._send_async(self._async, method, path, deadline, **kwargs)
            wait = retry_after(response)
            if wait is None or time.monotonic() + wait > deadline:
                return raise_for_status(response)
            await asyncio.sleep(wait)

    def _stop_sending(self) -> None:
        """Send what was submitted, then stop the threads."""
        with self._sending_lock:
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.shutdown(wait=True)

    async def aclose(self) -> None:
        """Close both clients (after sending the submissions in flight); call it on the event loop that made the
        async calls."""
        await asyncio.to_thread(self._stop_sending)
        client, self._async, self._async_loop = self._async, None, None
        if client is not None:
            await client.aclose()
        self._sync.close()

    def close(self) -> None:
        """Close both clients. The async one (if an async call opened it) is closed on its own event loop: at once
        when that loop is idle, waited for when it runs in another thread, scheduled when it is the loop running this
        call (the close then runs at the caller's next await). Connections of a loop that has ended cannot be closed
        any more: a ResourceWarning then says to `await aclose()` before the loop ends. Submissions in flight are
        sent first."""
        self._stop_sending()
        self._sync.close()
        client, loop = self._async, self._async_loop
        self._async = self._async_loop = None
        if client is None or loop is None:
            return
        running = _running_loop()
        closing = _aclose_or_warn(client)
        if loop.is_closed():
            loop = running
        if loop is None:
            asyncio.run(closing)
        elif loop is running:
            self._closing = loop.create_task(closing)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(closing, loop).result(self._timeout)
        else:
            loop.run_until_complete(closing)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _aclose_or_warn(client: httpx.AsyncClient) -> None:
    try:
        await client.aclose()
    except RuntimeError:  # "Event loop is closed": its connections belong to a loop that has ended
        warnings.warn(
            "the async HTTP client's connections outlived their event loop and could not be closed: "
            "`await client.aclose()` (or use `async with`) before the loop ends",
            ResourceWarning,
            stacklevel=2,
        )
