"""Stopping a long-running process on SIGTERM / SIGINT by setting a threading.Event, without a deadlock.

Python runs a signal handler in the main thread between two bytecodes, which may be inside `stop.set()` of an earlier
signal: Event.set holds the event's Condition lock (a plain, non-reentrant Lock) while it notifies, and a handler
calling stop.set() there waits for that lock forever. Seen with a pool process: two SIGTERMs a millisecond apart (one
from PR_SET_PDEATHSIG as the supervisor thread that started it ended, one from the supervisor's stop) left it hung
until SIGKILLed 60 s later, without its clean stop. So the handler sets nothing itself: a set that has not happened
yet is done by a thread of its own, which waits for the lock like any other thread."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable


def stop_on_signals(stop: threading.Event, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """From now on, each of `signals` sets `stop` (call from the main thread)."""

    def handler(_signum: int, _frame: object) -> None:
        if not stop.is_set():  # a plain read of the flag: no lock
            threading.Thread(target=stop.set, name="stop-signal", daemon=True).start()

    for sig in signals:
        signal.signal(sig, handler)
