"""Checkpoint files written beside the training path: one background thread, jobs keyed by the request that asked,
run in the order they were handed in.

The pool's executor hands a save's file write here (a sampler save: the weights were copied in the plan, the write
is not). The pool's finish step (pool/finish.py) either waits for it before it publishes the result (`take`), or, when
the save is in the durable request log, publishes at once and settles the checkpoint row once the files are there
(`then`); a later plan that reads the same folder waits for it first (`wait_folder`), and a durable snapshot is
recorded only after every write handed in before it (`barrier`).

`hold` (tests only): called on the writer thread before each job, so a test can keep a write from happening until it
killed the pool (the one fault that cannot be caused from outside: "answered, file not yet written")."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWrites:
    def __init__(self, hold: Callable[[], None] | None = None) -> None:
        self._hold = hold
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        self._lock = threading.Lock()
        self._by_request: dict[str, Future[dict[str, Any]]] = {}
        self._by_folder: dict[str, Future[dict[str, Any]]] = {}

    def submit(self, request_id: str, folder: str, job: Callable[[], dict[str, Any]]) -> None:
        """Run `job` (it writes `folder` and returns what the result adds, e.g. size and hash) in the background."""
        future = self._pool.submit(self._held(job))
        with self._lock:
            self._by_request[request_id] = future
            self._by_folder[folder] = future
        future.add_done_callback(lambda f: self._forget_folder(folder, f))

    def _forget_folder(self, folder: str, future: Future[dict[str, Any]]) -> None:
        with self._lock:
            if self._by_folder.get(folder) is future:
                del self._by_folder[folder]

    def _held(self, job: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        hold = self._hold
        if hold is None:
            return job

        def run() -> dict[str, Any]:
            hold()
            return job()

        return run

    def pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._by_request

    def take(self, request_id: str) -> dict[str, Any]:
        """Wait for this request's write: what its job returned (its exception re-raised)."""
        with self._lock:
            future = self._by_request.pop(request_id)
        return future.result()

    def then(self, request_id: str, settle: Callable[[Future[dict[str, Any]]], None]) -> None:
        """Hand this request's write to `settle` once it is done, on the writer thread (before the next write starts;
        queued behind the writes handed in so far when it is done already), never on the caller's, which goes on."""
        with self._lock:
            future = self._by_request.pop(request_id)
            if future.done():
                self._pool.submit(settle, future)
                return
        future.add_done_callback(settle)

    def barrier(self) -> Future[None]:
        """Done once every write handed in so far is done and settled (the writer runs them in order)."""
        return self._pool.submit(lambda: None)

    def wait_folder(self, folder: str) -> None:
        """Block until a write into `folder` still running is done (its error is the save's, not the reader's)."""
        with self._lock:
            future = self._by_folder.get(folder)
        if future is not None:
            future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
