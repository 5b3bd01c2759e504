"""The tenants' fair-share weights as the dispatcher reads them: the `tenants.weight` column through a cache, so a plan
costs no SQL. When any of a plan's tenants has an entry older than `ttl_s`, one SELECT reads all of the plan's tenants:
their entries then age together, so a steady set of tenants costs one SELECT per `ttl_s` (read one by one, entries
made at different times would expire one by one, a SELECT each: at 16 tenants ~16 per `ttl_s`, on the dispatcher's
thread between plans). A weight change reaches the policy within `ttl_s` (LORAPLEX_TENANT_WEIGHT_CACHE_SECONDS). A
failed read (the database away) keeps the weights known so far (1 for a tenant never read) and is retried on the next
plan after `retry_s`. The fetch is the pool's (pool/records.sql_weights): this module knows no SQL."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from loraplex.runtime.logutil import RateLimitedLog

log = logging.getLogger(__name__)

Fetch = Callable[[Collection[str]], Mapping[str, float]]


class TenantWeights:
    def __init__(
        self, fetch: Fetch, ttl_s: float = 30.0, retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._fetch = fetch
        self._ttl = ttl_s
        self._retry = retry_s
        self._clock = clock
        self._weights: dict[str, float] = {}
        self._read_at: dict[str, float] = {}  # tenant -> when its weight was read (or last tried)
        self._warn = RateLimitedLog(log, every_s=30.0)

    def of(self, tenants: Iterable[str]) -> dict[str, float]:
        """tenant -> weight for `tenants` (1.0 for one the database does not know)."""
        wanted = set(tenants)
        now = self._clock()
        stale = [t for t in wanted if now - self._read_at.get(t, -float("inf")) >= self._ttl]
        if stale:
            try:
                fresh = self._fetch(wanted)
            except Exception as exc:  # noqa: BLE001 - the pool keeps planning with what it knows
                self._warn.warning("reading tenant weights failed (%s: %s); retrying", type(exc).__name__, exc)
                for t in stale:  # try again after retry_s, not on every plan
                    self._read_at[t] = now - self._ttl + self._retry
            else:
                for t in wanted:
                    self._weights[t] = float(fresh.get(t, 1.0))
                    self._read_at[t] = now
        return {t: self._weights.get(t, 1.0) for t in wanted}
