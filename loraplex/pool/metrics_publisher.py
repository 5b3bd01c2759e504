"""A thread of the pool process that, every `every_s`, reads the queue depth per tenant from Redis into the pool's
metrics and publishes the whole registry to Redis (queue/published_metrics.py) for the gateways; once more when it
stops. Redis away: logged at most every 30 s, tried again next round."""

from __future__ import annotations

import logging
import threading

import redis as redis_lib

from loraplex.pool.metrics import PoolMetrics
from loraplex.queue import published_metrics
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
        """The registry in text format with the queue depths read now (the pool's own /metrics serves this)."""
        self._refresh_depths()
        return self.metrics.exposition()

    def publish_now(self) -> None:
        exposition = self.render()
        try:
            published_metrics.publish(self.redis, self.metrics.pool, exposition, TTL_ROUNDS * self.every_s)
        except redis_lib.RedisError as exc:
            self._warn.warning("publishing the pool's metrics failed (%s); retrying", exc)

    def _refresh_depths(self) -> None:
        try:
            self.metrics.queue_depths(published_metrics.queue_depths(self.redis, self.metrics.pool))
        except redis_lib.RedisError as exc:  # the gauges keep their last values
            self._warn.warning("reading the queue depths failed (%s); retrying", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publish_now()  # the last plans' numbers

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish_now()
            self._stop.wait(self.every_s)
