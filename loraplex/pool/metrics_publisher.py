"""A thread of the pool process that, every `every_s`, reads the queue depth per tenant from Redis into the pool's
metrics and publishes the whole registry to Redis (queue/published_metrics.py) for the gateways; once more when it
stops. Redis away: logged at most every 30 s, tried again next round."""

from __future__ import annotations

import logging
import threading

import redis as redis_lib

from loraplex.pool.metrics import PoolMetrics
from loraplex.queue import published_metrics, timeline
from loraplex.runtime.logutil import RateLimitedLog

log = logging.getLogger(__name__)

TTL_ROUNDS = 5  # the published text outlives this many missed rounds, then the pool drops out of /metrics/pools


class MetricsPublisher:
    def __init__(self, redis: redis_lib.Redis, metrics: PoolMetrics, every_s: float) -> None:
        self.redis, self.metrics, self.every_s = redis, metrics, every_s
        self._stop = threading.Event()
        self._warn = RateLimitedLog(log, every_s=30.0)
        self._thread = threading.Thread(target=self._run, name="pool-metrics", daemon=True)

    def start(self) -> MetricsPublisher:
        self._thread.start()
        return self

    def render(self) -> bytes:
        """The registry in text format with the queue depths, memory and disk read now (the pool's own /metrics
        serves this)."""
        self._refresh_depths()
        self.metrics.read_resources()
        return self.metrics.exposition()

    def publish_now(self) -> None:
        depths = self._refresh_depths()
        entry = self.metrics.timeline.take({t: n for t, (n, _) in depths.items()})  # reads memory and disk too
        exposition = self.metrics.exposition()
        try:
            published_metrics.publish(self.redis, self.metrics.pool, exposition, TTL_ROUNDS * self.every_s)
            if entry is not None:
                timeline.add(self.redis, timeline.POOL, self.metrics.pool, entry)
        except redis_lib.RedisError as exc:
            self._warn.warning("publishing the pool's metrics failed (%s); retrying", exc)

    def _refresh_depths(self) -> dict[str, tuple[int, int]]:
        try:
            depths = published_metrics.queue_depths(self.redis, self.metrics.pool)
        except redis_lib.RedisError as exc:  # the gauges keep their last values
            self._warn.warning("reading the queue depths failed (%s); retrying", exc)
            return {}
        self.metrics.queue_depths(depths)
        return depths

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publish_now()  # the last plans' numbers

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish_now()
            self._stop.wait(self.every_s)
