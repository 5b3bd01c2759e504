"""Logging and retrying through an outage without flooding the log: `RateLimitedLog` writes at most one line per
interval (and says how many it held back), `Backoff` grows a retry delay up to a cap. Stdlib only (every layer may
use it: the gateway's Redis-down handler, the dispatcher's threads, the pool's heartbeat)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """`warning(...)` / `error(...)` like a logger, but at most one record per `every_s` seconds; the next record
    written says how many were suppressed in between. Thread-safe."""

    def __init__(self, logger: logging.Logger, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next = float("-inf")
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log it if the interval has passed (True), else count it (False)."""
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._suppressed += 1
                return False
            self._next = now + self.every_s
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            msg = f"{msg} ({suppressed} similar message(s) suppressed)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, msg, *args)


class Backoff:
    """Retry delays: `first_s`, doubling up to `cap_s`; `reset()` after a success."""

    def __init__(self, first_s: float = 0.1, cap_s: float = 2.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self._delay = first_s

    def next(self) -> float:
        delay = self._delay
        self._delay = min(self.cap_s, self._delay * 2)
        return delay

    def reset(self) -> None:
        self._delay = self.first_s
