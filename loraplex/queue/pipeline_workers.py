"""Which pipelines workers (Celery, loraplex/pipelines/) are alive: each beats into one sorted set (queue/keys.
pipeline_workers: worker name -> when its heartbeat lapses, Redis's clock in ms) every `heartbeat_s`, and leaves it
when it stops cleanly; one killed drops out when its last beat lapses (three beats later). The gateway counts the
live ones for `loraplex finetune --wait` and `pipelines status` (service/pipelines.py)."""

from __future__ import annotations

import redis

from loraplex.queue import keys

LAPSE_BEATS = 3  # a worker counts as alive until three of its beats were missed

_NOW_MS = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"
# KEYS: the set. ARGV: worker name, ttl ms.
_BEAT = (
    _NOW_MS
    + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)
# KEYS: the set. Drops the lapsed beats, returns how many are left.
_ALIVE = (
    _NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)


def beat(client: redis.Redis, worker: str, heartbeat_s: float) -> None:
    """`worker` is alive for the next LAPSE_BEATS x heartbeat_s."""
    client.eval(_BEAT, 1, keys.pipeline_workers(), worker, int(LAPSE_BEATS * heartbeat_s * 1000))


def leave(client: redis.Redis, worker: str) -> None:
    client.zrem(keys.pipeline_workers(), worker)


def alive_count(client: redis.Redis) -> int:
    return int(client.eval(_ALIVE, 1, keys.pipeline_workers()))
