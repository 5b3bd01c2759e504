"""What a gateway process adds to the fleet's timeline (queue/timeline.py): the responses it sent since its last entry,
by status class (2xx, 4xx, 429 apart: the rejections, 5xx), and a latency histogram of its short calls (the
long-polls, which wait on purpose, left out); probes and scrapes are not counted. RequestMetrics (api/metrics.py) counts each response here beside its
Prometheus series; a task of the app's lifespan (`publish_forever`) adds one entry every `EVERY_S` when there was
traffic, else one every `IDLE_EVERY_S`, so the dashboard sees each gateway alive."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Any

import redis as redis_lib
from starlette.concurrency import run_in_threadpool

from loraplex import __version__
from loraplex.queue import latency_histogram, timeline

log = logging.getLogger(__name__)

EVERY_S = 2.0
IDLE_EVERY_S = 10.0
FORGET_AFTER_S = 3600.0  # a gateway silent this long leaves the dashboard's health table
FORGET_EVERY_ROUNDS = 150
LONG_POLL_MARKS = ("futures", "retrieve_future")  # route templates that wait for a result on purpose
# Probes and scrapes: a readiness probe's 503 while a pool loads is its answer, not a failure of anyone's call (the
# pools' health says it), and they would drown the callers' numbers.
PROBE_ROUTES = frozenset({"/v1/healthz", "/healthz", "/metrics", "/metrics/pools"})


def status_class(status: int) -> str:
    if status == 429:
        return "429"
    return f"{status // 100}xx"


class GatewayTally:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {}
        self._latency: latency_histogram.Histogram = {}
        self._last_sent = 0.0

    def observe(self, route: str, status: int, seconds: float) -> None:
        if route in PROBE_ROUTES:
            return
        with self._lock:
            key = status_class(status)
            self._status[key] = self._status.get(key, 0) + 1
            if not any(mark in route for mark in LONG_POLL_MARKS):
                latency_histogram.observe(self._latency, seconds)

    def take(self, force: bool = False) -> dict[str, Any] | None:
        now = time.monotonic()
        with self._lock:
            if not self._status and not force and now - self._last_sent < IDLE_EVERY_S:
                return None
            entry = {"status": self._status, "latency": self._latency}
            self._status, self._latency, self._last_sent = {}, {}, now
        return entry


TALLY = GatewayTally()


def gateway_id(port: int | None = None) -> str:
    return f"{socket.gethostname()}:{port or '-'}:{os.getpid()}"


async def publish_forever(redis: redis_lib.Redis, name: str, every_s: float = EVERY_S) -> None:
    """The lifespan's task: one timeline entry per round with something to say; Redis away: logged, tried again."""
    about = {"pid": os.getpid(), "version": __version__}
    warned = 0.0
    rounds = 0
    while True:
        await asyncio.sleep(every_s)
        rounds += 1
        entry = TALLY.take()
        if entry is None:
            continue
        try:
            await run_in_threadpool(timeline.add, redis, timeline.GATEWAY, name, {**entry, "about": about})
            if rounds % FORGET_EVERY_ROUNDS == 1:  # a restarted gateway has a new id: its old one goes after a while
                await run_in_threadpool(timeline.forget_gateways, redis, FORGET_AFTER_S)
        except redis_lib.RedisError as exc:
            if time.monotonic() - warned > 30:
                warned = time.monotonic()
                log.warning("gateway timeline: %s", exc)
