"""A SQL write that must land rides out a database outage: the whole transaction is run again from its start while
the database is unreachable (db.database_unavailable: a server stopped, crashed or restarting)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from loraplex.runtime.logutil import Backoff, RateLimitedLog
from loraplex.runtime.retry import retry_while_unreachable
from loraplex.storage.db import database_unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long a plan's SQL write waits for the database to come back before giving up (then the caller's own error
# handling: records logged as lost, a save failed with "not recorded").
DATABASE_OUTAGE_S = 600.0


def retry_database(
    call: Callable[[], T], what: str, warn: RateLimitedLog, outage_s: float = DATABASE_OUTAGE_S,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> T:  # fmt: skip
    """`call()` (one whole transaction), retried with backoff while the database is unreachable, for up to
    `outage_s` seconds; then that error is raised. Any other error is raised at once."""

    def unreachable(exc: Exception) -> str | None:
        if not database_unavailable(exc):
            return None
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return f"database unavailable while {what} ({type(exc).__name__}: {first_line}); retrying"

    def back(seconds: float) -> None:
        log.info("database available again: %s done after %.1f s", what, seconds)

    return retry_while_unreachable(call, unreachable, warn, outage_s, Backoff(cap_s=1.0), clock, sleep, back)
