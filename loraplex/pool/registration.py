"""The pool's registration in the fleet (queue/pool_registry.py), kept by a thread of the leader: published at once,
then every third of the lease's TTL with that TTL, so it lives exactly as long as a lease renewed at the same cadence
would; withdrawn on a clean stop. What it says (base model, world size, slots, device, free memory, queue depth, state)
is read fresh each round from `describe`. Redis away: logged at most every 30 s, tried again next round."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis as redis_lib

from loraplex.queue import pool_registry
from loraplex.queue.pool_registry import PoolRegistration, can_sample
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.settings import Settings

log = logging.getLogger(__name__)


def pool_describer(
    settings: Settings,
    redis: redis_lib.Redis,
    world: int,
    state: Callable[[], str],
    free_memory: Callable[[], int | None],
) -> Callable[[], PoolRegistration]:
    """What this pool publishes each round: its settings, its state now, its device's free memory and its queue's
    load read now (one round trip)."""

    def describe() -> PoolRegistration:
        requests, tokens = pool_registry.queue_load(redis, settings.pool)
        return PoolRegistration(
            name=settings.pool,
            base_model=settings.base_model,
            world_size=world,
            slots=settings.slots,
            max_rank=settings.max_rank,
            target_modules=tuple(settings.target_modules),
            device=settings.device,
            free_memory_bytes=free_memory(),
            queued_requests=requests,
            queued_tokens=tokens,
            state=state(),
            sampleable=can_sample(settings.sampler, world),
        )

    return describe


class RegistrationKeeper:
    def __init__(self, redis: redis_lib.Redis, describe: Callable[[], PoolRegistration], ttl_s: float) -> None:
        self.redis, self.describe, self.ttl_s = redis, describe, ttl_s
        self._stop = threading.Event()
        self._warn = RateLimitedLog(log, every_s=30.0)
        self._thread = threading.Thread(target=self._run, name="pool-registration", daemon=True)
        self._name: str | None = None

    def start(self) -> RegistrationKeeper:
        self._thread.start()
        return self

    def publish_now(self) -> None:
        try:
            registration = self.describe()
            self._name = registration.name
            pool_registry.publish(self.redis, registration, self.ttl_s)
        except redis_lib.RedisError as exc:
            self._warn.warning("publishing the pool's registration failed (%s); retrying", exc)

    def close(self, withdraw: bool = True) -> None:
        """Stop publishing; `withdraw` also removes the registration now (a clean stop), else it lapses by its TTL."""
        self._stop.set()
        self._thread.join(timeout=5)
        if withdraw and self._name is not None:
            try:
                pool_registry.withdraw(self.redis, self._name)
            except redis_lib.RedisError as exc:
                log.warning("withdrawing the pool's registration failed (%s); it lapses by itself", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish_now()
            self._stop.wait(self.ttl_s / 3)
