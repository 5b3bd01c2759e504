"""A pipelines worker says it is alive (queue/pipeline_workers.py) from when Celery calls it ready until it shuts down:
a thread beats every `pipeline_worker_heartbeat_seconds`; a clean shutdown leaves the set at once. The gateway counts
the live workers, so `loraplex finetune --wait` can say that none is (instead of waiting forever)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import redis
from celery import signals

from loraplex.queue import pipeline_workers
from loraplex.settings import get_settings

log = logging.getLogger("loraplex.pipelines.heartbeat")


class WorkerHeartbeat:
    def __init__(self, client: redis.Redis, name: str, every_s: float) -> None:
        self.client = client
        self.name = name
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipelines-heartbeat", daemon=True)

    def start(self) -> WorkerHeartbeat:
        """The first beat now (the worker counts as alive once this returns), the next ones on a thread."""
        self._beat()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._beat()

    def _beat(self) -> None:
        try:
            pipeline_workers.beat(self.client, self.name, self.every_s)
        except redis.RedisError as exc:  # Redis away: the worker lives on, and beats again when it is back
            log.warning("pipelines worker heartbeat: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # else it lapses on its own
            pipeline_workers.leave(self.client, self.name)


_running: WorkerHeartbeat | None = None


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    global _running
    settings = get_settings()
    name = f"{getattr(sender, 'hostname', 'celery')} pid {os.getpid()}"
    client = redis.Redis.from_url(settings.redis_url or settings.resolved_celery_broker_url)
    _running = WorkerHeartbeat(client, name, settings.pipeline_worker_heartbeat_seconds).start()


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    if _running is not None:
        _running.stop()
