"""What a gateway has queued on its pool, read straight from Redis (tests of the gateway without a pool)."""

from __future__ import annotations

from loraplex.protocol import RequestKind
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, decode


def tenant_streams(redis, pool: str) -> list[str]:
    """The request stream of every tenant that has one on `pool`."""
    return sorted(keys.request_stream(pool, t.decode() if isinstance(t, bytes) else t)
                  for t in redis.smembers(keys.pool_tenants(pool)))  # fmt: skip


def queue_length(redis, pool: str) -> int:
    """Entries in all of the pool's request streams (answered ones are deleted)."""
    return sum(redis.xlen(s) for s in tenant_streams(redis, pool))


def queued(services, pool: str | None = None) -> dict[str, Envelope]:
    """request_id -> envelope of everything queued on `pool` (default: the gateway's own), per tenant in arrival
    order."""
    pool = pool or services.settings.pool
    entries = [e for stream in tenant_streams(services.redis, pool) for e in services.redis.xrange(stream)]
    return {env.request_id: env for env in (decode(fields) for _, fields in entries)}


def queued_work(services) -> dict[str, Envelope]:
    """`queued` less the rejections held in rejected requests' seq_ids (service/rejections.py)."""
    return {rid: env for rid, env in queued(services).items() if env.kind != RequestKind.REJECTED}


def rejections(services) -> dict[tuple[str, int], Envelope]:
    """(model_id, seq_id) -> the queued rejection in that seq_id's place."""
    return {(e.model_id, e.seq_id): e for e in queued(services).values() if e.kind == RequestKind.REJECTED}
