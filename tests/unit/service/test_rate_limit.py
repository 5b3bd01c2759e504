"""The per-tenant token bucket (service/rate_limit.py), on a clock the test moves."""

from __future__ import annotations

import pytest

from loraplex.errors import QuotaExceededError
from loraplex.service.rate_limit import TenantRateLimit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_and_tenants_apart() -> None:
    clock = Clock()
    limit = TenantRateLimit(rate_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        limit.take("a", "alice")
    with pytest.raises(QuotaExceededError) as over:
        limit.take("a", "alice")
    assert over.value.retry_after_s == pytest.approx(0.5) and "2 requests/s" in over.value.message
    limit.take("b", "bob")  # another tenant has its own bucket
    clock.now += 0.5
    limit.take("a", "alice")  # one token back after 1/rate seconds
    with pytest.raises(QuotaExceededError):
        limit.take("a", "alice")
    clock.now += 60
    for _ in range(3):  # refilled to the burst, never past it
        limit.take("a", "alice")
    with pytest.raises(QuotaExceededError):
        limit.take("a", "alice")


def test_rate_zero_is_off() -> None:
    limit = TenantRateLimit(rate_per_s=0.0, burst=1)
    for _ in range(1000):
        limit.take("a", "alice")
