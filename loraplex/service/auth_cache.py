"""Recently checked API keys of one gateway process, so the hot training calls do not query SQL (and hop to a worker
thread) to authenticate every request. Entries expire after `ttl_s`: a revoked key stops working within that time
everywhere. Keys are held by their SHA-256 hash, never in plain text; failed checks are not cached."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class AuthCache(Generic[T]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, T]] = OrderedDict()  # hash -> (expires at, value), oldest first

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    def get(self, key: str) -> T | None:
        if self.ttl_s <= 0:
            return None
        digest = self._digest(key)
        entry = self._entries.get(digest)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[digest]
            return None
        return entry[1]

    def put(self, key: str, value: T) -> None:
        if self.ttl_s <= 0:
            return
        digest = self._digest(key)
        self._entries.pop(digest, None)
        self._entries[digest] = (self._clock() + self.ttl_s, value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry: the next call of each key reads SQL (an operator changed a tenant on this process)."""
        self._entries.clear()
