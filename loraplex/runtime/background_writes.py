"""Checkpoint files written beside the training path: one background thread, jobs keyed by the request that asked.

The pool's executor hands a save's file write here (a sampler save: the weights were copied in the plan, the write
is not), the pool's finish step (pool/finish.py) waits for it before it records the checkpoint row and publishes the
result (so a client that sees the result can read the files), and a later plan that reads the same folder waits for it
first."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWrites:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        self._lock = threading.Lock()
        self._by_request: dict[str, Future[dict[str, Any]]] = {}
        self._by_folder: dict[str, Future[dict[str, Any]]] = {}

    def submit(self, request_id: str, folder: str, job: Callable[[], dict[str, Any]]) -> None:
        """Run `job` (it writes `folder` and returns what the result adds, e.g. size and hash) in the background."""
        future = self._pool.submit(job)
        with self._lock:
            self._by_request[request_id] = future
            self._by_folder[folder] = future
        future.add_done_callback(lambda f: self._forget_folder(folder, f))

    def _forget_folder(self, folder: str, future: Future[dict[str, Any]]) -> None:
        with self._lock:
            if self._by_folder.get(folder) is future:
                del self._by_folder[folder]

    def pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._by_request

    def take(self, request_id: str) -> dict[str, Any]:
        """Wait for this request's write: what its job returned (its exception re-raised)."""
        with self._lock:
            future = self._by_request.pop(request_id)
        return future.result()

    def wait_folder(self, folder: str) -> None:
        """Block until a write into `folder` still running is done (its error is the save's, not the reader's)."""
        with self._lock:
            future = self._by_folder.get(folder)
        if future is not None:
            future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
