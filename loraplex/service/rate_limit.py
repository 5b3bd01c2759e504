"""Per-tenant request rate limit of one gateway process: a token bucket per tenant (`LORAPLEX_TENANT_REQUESTS_PER_SECOND`,
burst `LORAPLEX_TENANT_REQUEST_BURST`), checked right after authentication on every authenticated route (native and
Tinker). Over it: 429 with Retry-After (the time until the next token), which both clients honour. It protects the
gateway and the database from one tenant's flood of cheap calls; the queue quotas (queue/producer.py) bound the work a
tenant can queue. Per process, in memory (no Redis round trip): N gateway replicas admit up to N times the rate."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from loraplex.errors import QuotaExceededError


@dataclass
class _Bucket:
    tokens: float
    at: float


class TenantRateLimit:
    def __init__(self, rate_per_s: float, burst: int, clock=time.monotonic) -> None:
        self.rate = rate_per_s
        self.burst = max(1, burst)
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, tenant_id: str, tenant_name: str) -> None:
        """Spend one request of the tenant's bucket, or raise QuotaExceededError (429) saying when to retry."""
        if self.rate <= 0:
            return
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(tenant_id)
            if bucket is None:
                bucket = self._buckets[tenant_id] = _Bucket(float(self.burst), now)
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return
            wait = (1.0 - bucket.tokens) / self.rate
        raise QuotaExceededError(
            f"tenant {tenant_name} is over {self.rate:g} requests/s (LORAPLEX_TENANT_REQUESTS_PER_SECOND); "
            f"retry in {wait:.2f} s",
            retry_after_s=wait,
        )
