"""This gateway process's view of the fleet (service/fleet.py over the registry, queue/pool_registry.py), read again
at most once a second: placement, the served models and the sampling routes ask on every call. While Redis cannot be
read the last view stands (or the gateway's own pool alone), so the answers that need no queue keep working."""

from __future__ import annotations

import logging
import threading
import time

import redis as redis_lib

from loraplex.queue import pool_registry
from loraplex.queue.pool_registry import PoolRegistration, can_sample
from loraplex.service.fleet import Fleet, fleet_of
from loraplex.settings import Settings

log = logging.getLogger(__name__)

FLEET_VIEW_SECONDS = 1.0


def home_registration(settings: Settings) -> PoolRegistration:
    """The gateway's own pool as its settings describe it (no load figures: it has not registered)."""
    return PoolRegistration(
        name=settings.pool,
        base_model=settings.base_model,
        world_size=settings.world_size,
        slots=settings.slots,
        max_rank=settings.max_rank,
        target_modules=tuple(settings.target_modules),
        device=settings.device,
        state="unregistered",
        sampleable=can_sample(settings.sampler, settings.world_size),
        published_at=0.0,
    )


class FleetView:
    def __init__(self, ttl_s: float = FLEET_VIEW_SECONDS) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._value: tuple[float, Fleet] | None = None

    def get(self, settings: Settings, redis: redis_lib.Redis) -> Fleet:
        with self._lock:
            if self._value is not None and self._value[0] > time.monotonic():
                return self._value[1]
            last = self._value[1] if self._value is not None else None
        home = home_registration(settings)
        try:
            fleet = fleet_of(pool_registry.live_pools(redis), home)
        except redis_lib.RedisError as exc:
            log.debug("reading the fleet's registry failed (%s); keeping the last view", exc)
            return last if last is not None else fleet_of([], home)
        with self._lock:
            self._value = (time.monotonic() + self.ttl_s, fleet)
        return fleet

    def forget(self) -> None:
        """Read the registry again on the next call."""
        with self._lock:
            self._value = None
