"""How much login work one gateway process takes on: attempts per client address and per typed username in a sliding
window, and scrypt checks at once. Past any of them the login answers 429 with Retry-After, before a hash is computed,
so a flood of guesses costs the tenants' requests at most `admin_login_checks_at_once` cores of scrypt.

Counted in this process's memory: N gateway processes allow N times the attempts (the account lockout, kept in the
database, is what bounds guessing across them); the tables keep at most MAX_KEYS keys each, the least recently seen
dropped first, so a flood of made-up usernames cannot grow them."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.errors import CapacityError
from loraplex.settings import Settings

MAX_KEYS = 10_000
CHECK_WAIT_S = 1.0  # how long an attempt waits for a check's place before its 429 (and the Retry-After it names)


class SlidingWindow:
    """At most `limit` events per key in any `window_s` seconds (thread-safe)."""

    def __init__(self, limit: int, window_s: float, max_keys: int = MAX_KEYS) -> None:
        self.limit, self.window_s, self.max_keys = limit, window_s, max_keys
        self._events: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str, now: float | None = None) -> float:
        """Count one event for `key`: 0.0 if allowed, else the seconds until one is (nothing counted then)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            events = self._events.get(key)
            if events is None:
                events = self._events[key] = deque()
                while len(self._events) > self.max_keys:
                    self._events.popitem(last=False)
            self._events.move_to_end(key)
            while events and events[0] <= now - self.window_s:
                events.popleft()
            if len(events) >= self.limit:
                return events[0] + self.window_s - now
            events.append(now)
            return 0.0


class LoginLimits:
    def __init__(self, settings: Settings) -> None:
        window = settings.admin_login_window_seconds
        self.per_client = SlidingWindow(settings.admin_login_attempts_per_client, window)
        self.per_account = SlidingWindow(settings.admin_login_attempts_per_account, window)
        self._checks = threading.BoundedSemaphore(settings.admin_login_checks_at_once)

    def admit_client(self, client: str) -> None:
        """Count an attempt from address `client`; CapacityError (429) past `admin_login_attempts_per_client`."""
        wait = self.per_client.take(client)
        if wait:
            raise _too_many(f"too many login attempts from this address (admin_login_attempts_per_client = "
                            f"{self.per_client.limit} per {self.per_client.window_s:g} s)", wait)  # fmt: skip

    def admit_account(self, username: str) -> None:
        """Count an attempt at `username` (known or not: the answer must not tell); CapacityError (429) past
        `admin_login_attempts_per_account`. Not asked for a browser with the account's trusted-device cookie, so
        guessers hammering a username cannot keep its admin out."""
        wait = self.per_account.take(username[:64])
        if wait:
            raise _too_many(f"too many login attempts for this username (admin_login_attempts_per_account = "
                            f"{self.per_account.limit} per {self.per_account.window_s:g} s)", wait)  # fmt: skip

    @contextmanager
    def checking(self) -> Iterator[None]:
        """Hold one of the `admin_login_checks_at_once` places while a password is checked (a worker thread waits up
        to CHECK_WAIT_S for one); 429 when none came free."""
        if not self._checks.acquire(timeout=CHECK_WAIT_S):
            raise _too_many("the admin login is busy (admin_login_checks_at_once)", CHECK_WAIT_S)
        try:
            yield
        finally:
            self._checks.release()


def _too_many(reason: str, wait_s: float) -> CapacityError:
    retry = max(1, math.ceil(wait_s))
    return CapacityError(f"{reason}; retry in {retry} s", retry_after_s=retry)
