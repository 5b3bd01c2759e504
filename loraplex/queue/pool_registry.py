"""The fleet's registry in Redis: each pool's leader publishes what it serves and how loaded it is
(`PoolRegistration`) under keys.pool_registration, with the pool lease's TTL and at the lease's renewal cadence, and
names itself in keys.fleet_pools. A pool whose leader is gone (killed, its machine lost) drops out when its lease
would lapse; a clean stop withdraws it at once. Gateways read every live registration in one SMEMBERS and one MGET
(`live_pools`); which base models that serves is decided in service/fleet.py."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import orjson
import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.redis_text import text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolRegistration:
    """One pool as its leader describes it. Load figures are as of `published_at` (seconds since the epoch)."""

    name: str
    base_model: str
    world_size: int = 1
    slots: int = 0  # resident adapter slots (every rank holds the same adapters)
    max_rank: int = 0
    target_modules: tuple[str, ...] = ()
    device: str = "cpu"
    free_memory_bytes: int | None = None  # the device's free memory (CPU: the host's available memory)
    queued_requests: int = 0  # accepted, not yet answered, over all tenants
    queued_tokens: int = 0
    state: str = "loading"  # storage.enums.PoolState's value: loading, ready
    sampleable: bool = True  # whether its sampler can sample (native, or vLLM on one rank)
    published_at: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> PoolRegistration | None:
        """The registration, or None for one this build cannot read (logged: a pool of another version)."""
        try:
            fields: dict[str, Any] = orjson.loads(raw)
            fields["target_modules"] = tuple(fields.get("target_modules", ()))
            known = {k: v for k, v in fields.items() if k in cls.__dataclass_fields__}
            return cls(**known)
        except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
            log.warning(
                "a pool registration could not be read (%s): %r",
                exc,
                bytes(raw[:200]) if isinstance(raw, bytes) else raw[:200],
            )
            return None


def can_sample(sampler: str, world_size: int) -> bool:
    """Whether a pool with this sampler setting samples: the native sampler on any number of ranks (with several,
    each rank decodes its share on a whole copy of the base model), vLLM on one rank (its pool process runs none
    beside several ranks), "none" never."""
    return sampler == "native" or (sampler == "vllm" and world_size <= 1)


def publish(redis: redis_lib.Redis, registration: PoolRegistration, ttl_s: float) -> None:
    """Write (or refresh) the pool's registration, live for `ttl_s` unless published again."""
    pipe = redis.pipeline(transaction=False)
    pipe.set(keys.pool_registration(registration.name), registration.encode(), px=max(1, round(ttl_s * 1000)))
    pipe.sadd(keys.fleet_pools(), registration.name)
    pipe.hset(keys.fleet_last_seen(), registration.name, repr(registration.published_at))
    pipe.execute()


def withdraw(redis: redis_lib.Redis, pool: str) -> None:
    """The pool leaves the fleet now (a clean stop): gateways stop placing adapters on it."""
    redis.delete(keys.pool_registration(pool))


def live_pools(redis: redis_lib.Redis) -> list[PoolRegistration]:
    """Every pool whose registration is live, by name."""
    names = sorted(text(n) for n in cast(set, redis.smembers(keys.fleet_pools())))
    if not names:
        return []
    values = cast(list, redis.mget([keys.pool_registration(n) for n in names]))
    found = (PoolRegistration.decode(v) for v in values if v is not None)
    return [r for r in found if r is not None]


def queue_load(redis: redis_lib.Redis, pool: str) -> tuple[int, int]:
    """(requests, tokens) queued on `pool` over all its tenants: its streams' lengths and the quota's token counts."""
    tenants = [text(t) for t in cast(set, redis.smembers(keys.pool_tenants(pool)))]
    pipe = redis.pipeline(transaction=False)
    for tenant in tenants:
        pipe.xlen(keys.request_stream(pool, tenant))
    pipe.hvals(keys.queued_tokens(pool))
    *lengths, tokens = pipe.execute()
    return sum(int(n) for n in lengths), sum(int(text(t)) for t in cast(list, tokens))


def registered_pools(redis: redis_lib.Redis) -> dict[str, float]:
    """Every pool that ever registered, with when its leader last did (seconds since the epoch; 0 if not recorded)."""
    names = sorted(text(n) for n in cast(set, redis.smembers(keys.fleet_pools())))
    seen = {text(k): float(text(v)) for k, v in cast(dict, redis.hgetall(keys.fleet_last_seen())).items()}
    return {name: seen.get(name, 0.0) for name in names}
