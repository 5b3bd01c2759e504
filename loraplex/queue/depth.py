"""How many requests wait in a pool's queue, per tenant (the admin's dashboard; one round trip per call).

A tenant's queued requests are its request stream's entries (keys.request_stream): the producer adds one per request
and the pool deletes it with its ack, which is also what the per-tenant quota counts."""

from __future__ import annotations

from typing import cast

import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.redis_text import text


def queue_depths(redis: redis_lib.Redis, pool: str) -> dict[str, int]:
    """tenant id -> requests in its stream on `pool` (tenants that ever queued there; 0 when drained)."""
    tenants = sorted(text(t) for t in cast(set[bytes], redis.smembers(keys.pool_tenants(pool))))
    if not tenants:
        return {}
    pipe = redis.pipeline(transaction=False)
    for tenant in tenants:
        pipe.xlen(keys.request_stream(pool, tenant))
    return {tenant: int(n) for tenant, n in zip(tenants, pipe.execute(), strict=True)}


def tenant_queue_depth(redis: redis_lib.Redis, pools: list[str], tenant_id: str) -> dict[str, int]:
    """pool -> requests `tenant_id` has queued there (every pool named, 0 where none), in one round trip."""
    if not pools:
        return {}
    pipe = redis.pipeline(transaction=False)
    for pool in pools:
        pipe.xlen(keys.request_stream(pool, tenant_id))
    return {pool: int(n) for pool, n in zip(pools, pipe.execute(), strict=True)}
