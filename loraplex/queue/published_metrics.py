"""The pool's metrics as Redis holds them, so every gateway can serve them (GET /metrics/pools) and the admin
dashboard can read them without reaching the pool's port: the pool writes its registry's text format under
keys.pool_metrics (with a TTL: a pool that stopped publishing drops out) and names itself in keys.metrics_pools.
Also the queue depth per tenant, read from the streams themselves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.redis_text import text


def publish(redis: redis_lib.Redis, pool: str, exposition: bytes, ttl_s: float) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.set(keys.pool_metrics(pool), exposition, px=max(1, int(ttl_s * 1000)))
    pipe.sadd(keys.metrics_pools(), pool)
    pipe.execute()


def read_all(redis: redis_lib.Redis) -> dict[str, bytes]:
    """pool -> its latest published metrics (pools whose published text expired are left out)."""
    pools = sorted(text(p) for p in cast(set, redis.smembers(keys.metrics_pools())))
    if not pools:
        return {}
    values = cast(list, redis.mget([keys.pool_metrics(p) for p in pools]))
    return {pool: v.encode() if isinstance(v, str) else bytes(v) for pool, v in zip(pools, values, strict=True) if v}


def queue_depths(redis: redis_lib.Redis, pool: str) -> dict[str, tuple[int, int]]:
    """tenant -> (requests in its stream: accepted, not yet answered; their tokens) for every tenant of the pool."""
    tenants = sorted(text(t) for t in cast(set, redis.smembers(keys.pool_tenants(pool))))
    pipe = redis.pipeline(transaction=False)
    for tenant in tenants:
        pipe.xlen(keys.request_stream(pool, tenant))
    pipe.hgetall(keys.queued_tokens(pool))
    *lengths, raw_tokens = pipe.execute()
    tokens = {text(k): int(text(v)) for k, v in cast(Mapping, raw_tokens).items()}
    return {t: (int(n), tokens.get(t, 0)) for t, n in zip(tenants, lengths, strict=True)}
