"""A transport's futures not settled yet, oldest first: a long-poll for one of them names the others (the futures
route's `also`, at most MAX_ALSO), and those the gateway answers as finished are settled from that same answer. So a
training loop that awaits its forward_backward, then its optim_step (finished in the same plan), makes one round trip
for both, and its next request reaches the pool a round trip sooner.

Weak references: a future dropped unawaited leaves the table at the next look (no callbacks, so a garbage collection
inside the lock cannot re-enter it)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

MAX_ALSO = 16  # other futures one poll asks about (the gateway takes up to 32)


class Settleable(Protocol):
    @property
    def request_id(self) -> str: ...

    def settle_from(self, body: dict[str, Any]) -> None: ...


class UnsettledFutures:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, weakref.ref[Settleable]] = {}

    def add(self, future: Settleable) -> None:
        with self._lock:
            self._futures[future.request_id] = weakref.ref(future)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._futures.pop(request_id, None)

    def others(self, request_id: str) -> list[str]:
        """Up to MAX_ALSO request ids of live unsettled futures other than `request_id`, oldest first."""
        out: list[str] = []
        with self._lock:
            for rid, ref in list(self._futures.items()):
                if ref() is None:
                    del self._futures[rid]
                elif rid != request_id and len(out) < MAX_ALSO:
                    out.append(rid)
        return out

    def settle(self, bodies: Iterable[dict[str, Any]]) -> None:
        """Finished futures as the gateway answered them (complete or failed)."""
        for body in bodies:
            with self._lock:
                ref = self._futures.pop(str(body.get("request_id")), None)
            future = ref() if ref is not None else None
            if future is not None:
                future.settle_from(body)
