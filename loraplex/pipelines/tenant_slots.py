"""Per-tenant fairness among the Celery workers: at most `max_running_pipelines_per_tenant` pipelines of one tenant
train at once. The broker's queue is one FIFO; a tenant's 16-point sweep put ahead of another tenant's pipeline would
otherwise take every worker slot for its whole run. A task whose tenant is at its cap gives its slot back at once
(tasks.py: retried after `pipeline_slot_wait_seconds`, held by the worker as a timed task, not in a slot), so the
queue moves on to the other tenants' tasks.

The claims are a sorted set per tenant in Redis (queue/keys.pipeline_tenant_running): pipeline id -> when the claim
lapses (Redis's clock, ms). The runner lease renews the claim with itself (lease.py) and gives it back at the end; a
claim whose worker died lapses after the lease TTL. Taking is one script (drop lapsed claims, count, add), so workers
racing for a tenant's last claim cannot both win. A pipeline that already holds a claim (its earlier run died) takes
it again."""

from __future__ import annotations

import redis

from loraplex.queue import keys

_NOW_MS = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"
# KEYS: the tenant's claims. ARGV: pipeline id, cap, ttl ms.
_TAKE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""
_RENEW = _NOW_MS + """
local renewed = redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return renewed
"""


class TenantSlots:
    def __init__(self, client: redis.Redis, tenant_id: str, cap: int, ttl_s: float) -> None:
        """cap: the tenant's pipelines training at once (0: no cap); ttl_s: how long a claim outlives its last
        renewal (the runner lease's TTL)."""
        self._redis = client
        self._key = keys.pipeline_tenant_running(tenant_id)
        self.cap = cap
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def take(self, pipeline_id: str) -> bool:
        """Claim a place for `pipeline_id`; False when the tenant's other pipelines hold all `cap` of them."""
        if self.cap <= 0:
            return True
        return bool(self._redis.eval(_TAKE, 1, self._key, pipeline_id, self.cap, self._ttl_ms))

    def renew(self, pipeline_id: str) -> None:
        if self.cap > 0:
            self._redis.eval(_RENEW, 1, self._key, pipeline_id, self._ttl_ms)

    def give_back(self, pipeline_id: str) -> None:
        if self.cap > 0:
            self._redis.zrem(self._key, pipeline_id)

    def holders(self) -> list[str]:
        """The pipelines holding a claim now (lapsed ones included until the next take drops them)."""
        return [m.decode() if isinstance(m, bytes) else str(m) for m in self._redis.zrange(self._key, 0, -1)]
