"""The durable request log (DESIGN, Durability): every answered request of an adapter since its durable snapshot
before last, so a restarted pool can rebuild the adapter's state from a snapshot and the requests after it.

The dispatcher's ack script (queue/consumer.py) moves an answered entry's envelope from its tenant's stream into the
adapter's sorted set `loraplex:pool:{pool}:replay:{model_id}` (score: seq_id; create_adapter has -1) in one script,
so an answered request is always in one of the two. A member is a one-letter action then the envelope JSON: "a" to
apply on replay (it changed or may change the adapter's state and succeeded), "s" only to advance the seq_id chain
(it failed, or changes nothing). Deleting the adapter drops its log. With Redis persistence on (AOF: redis_child.py)
the log survives a Redis restart too.

When a newer snapshot is recorded, the entries at or below the *previous* snapshot's seq_id are trimmed (`trim`): the
log covers the last two snapshots, so a snapshot that fails its hash check can be skipped for the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, decode_data
from loraplex.queue.redis_text import text

APPLY, SKIP, DROP = "a", "s", "x"


@dataclass(frozen=True)
class LoggedRequest:
    seq_id: int
    apply: bool  # False: only advances the seq_id chain on replay
    envelope: Envelope


def logged_adapters(redis: redis_lib.Redis, pool: str) -> list[str]:
    return sorted(text(m) for m in redis.smembers(keys.replay_adapters(pool)))


def read_after(redis: redis_lib.Redis, pool: str, model_id: str, after_seq: int | None) -> list[LoggedRequest]:
    """The adapter's logged requests with seq_id > `after_seq` (None: all, the creation included), in seq_id order;
    one per seq_id (a request logged twice, e.g. by a redelivery, keeps its first copy)."""
    low = "-inf" if after_seq is None else f"({after_seq}"
    out: list[LoggedRequest] = []
    seen: set[int] = set()
    rows = cast(list[tuple[bytes, float]], redis.zrangebyscore(keys.replay_log(pool, model_id), low, "+inf", withscores=True))
    for member, score in rows:
        raw = text(member)
        seq = int(score)
        if seq in seen:
            continue
        seen.add(seq)
        out.append(LoggedRequest(seq, raw[0] == APPLY, decode_data(raw[1:])))
    return out


def trim(redis: redis_lib.Redis, pool: str, model_id: str, upto_seq: int) -> None:
    """Drop the entries at or below `upto_seq` (a snapshot covers them, and a newer one exists)."""
    redis.zremrangebyscore(keys.replay_log(pool, model_id), "-inf", upto_seq)


def drop(redis: redis_lib.Redis, pool: str, model_id: str) -> None:
    pipe = redis.pipeline()
    pipe.delete(keys.replay_log(pool, model_id))
    pipe.srem(keys.replay_adapters(pool), model_id)
    pipe.execute()
