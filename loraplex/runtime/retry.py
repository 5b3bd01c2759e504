"""Riding out an outage of a service the process needs (Redis, the database): a call retried with backoff while the
error says the service is unreachable, for a bounded time, with rate-limited warnings."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from loraplex.runtime.logutil import Backoff, RateLimitedLog

T = TypeVar("T")


def retry_while_unreachable(
    call: Callable[[], T], unreachable: Callable[[Exception], str | None], warn: RateLimitedLog, outage_s: float,
    backoff: Backoff, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    back: Callable[[float], None] | None = None,
) -> T:  # fmt: skip
    """`call()`, again after a backoff while `unreachable(exc)` names the outage (its warning), for up to `outage_s`;
    any other error, or the outage outlasting that, is raised. `back(seconds)` is told when a call succeeds after
    an outage."""
    deadline = clock() + outage_s
    failed_at: float | None = None
    while True:
        try:
            value = call()
        except Exception as exc:
            message = unreachable(exc)
            if message is None or clock() >= deadline:
                raise
            failed_at = clock() if failed_at is None else failed_at
            warn.warning("%s", message)
            sleep(backoff.next())
            continue
        if failed_at is not None and back is not None:
            back(clock() - failed_at)
        return value
