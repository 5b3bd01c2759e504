"""How many long-polls (GET /v1/futures, Tinker's retrieve_future, the OpenAI routes' wait for their samples) one
gateway process holds at once: at most `max_long_polls_per_tenant` per tenant and `max_long_polls` in all, each
answered 429 with Retry-After past it (our client and the Tinker SDK both back off and poll again).

A waiting long-poll holds a worker thread and a Redis connection of the long-poll pool (service/build.py) for up to
`long_poll_seconds`; without these bounds one tenant with a few hundred outstanding futures held every thread and
connection, and every other tenant's calls failed. Per process, in memory: N gateway replicas hold up to N times."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.errors import CapacityError, QuotaExceededError

RETRY_AFTER_S = 1.0  # a slot frees as soon as any of the tenant's waits answers: poll again soon


def process_long_polls(max_long_polls: int, gateway_threads: int) -> int:
    """The long-polls one process holds at once: the setting, but never more than half its worker threads, so the
    short calls always find one."""
    return max(1, min(max_long_polls, gateway_threads // 2))


class LongPollSlots:
    def __init__(self, per_tenant: int, total: int) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._held: dict[str, int] = {}
        self._all = 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, tenant_id: str, tenant_name: str) -> Iterator[None]:
        """One long-poll slot of the tenant for the block, or QuotaExceededError / CapacityError (429) at once."""
        with self._lock:
            held = self._held.get(tenant_id, 0)
            if held >= self.per_tenant:
                raise QuotaExceededError(
                    f"tenant {tenant_name} already has {held} long-polls waiting on this gateway, its limit "
                    f"(LORAPLEX_MAX_LONG_POLLS_PER_TENANT={self.per_tenant}); retry when one has answered",
                    retry_after_s=RETRY_AFTER_S,
                )
            if self._all >= self.total:
                raise CapacityError(
                    f"this gateway already holds {self._all} long-polls, its limit (LORAPLEX_MAX_LONG_POLLS, at most "
                    f"half of LORAPLEX_GATEWAY_THREADS); retry shortly",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._held[tenant_id] = held + 1
            self._all += 1
        try:
            yield
        finally:
            with self._lock:
                self._all -= 1
                left = self._held[tenant_id] - 1
                if left:
                    self._held[tenant_id] = left
                else:
                    del self._held[tenant_id]

    def held(self, tenant_id: str) -> int:
        with self._lock:
            return self._held.get(tenant_id, 0)
