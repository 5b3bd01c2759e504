"""The pipelines worker's command line (a Celery worker of loraplex/pipelines/app.py, threads pool: a pipeline waits
on the service most of the time), shared by `loraplex pipelines worker` and the embedded stack's supervised child;
and how the stack waits for it: its heartbeat (queue/pipeline_workers.py) names its pid once Celery is ready."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import redis

from loraplex.queue import keys

CELERY_APP = "loraplex.pipelines.app:celery_app"


def celery_worker_argv(node: str, concurrency: int, beat_schedule: Path | None = None) -> list[str]:
    """`python -m celery ... worker`; with `beat_schedule` it also runs the beat (checkpoint retention, missed
    exports) in its own process, the schedule's state in that file: one such worker per deployment."""
    argv = [sys.executable, "-m", "celery", "-A", CELERY_APP, "worker", "--pool=threads",
            f"--concurrency={concurrency}", "-n", f"{node}@%h", "--loglevel=INFO"]  # fmt: skip
    if beat_schedule is not None:
        argv += ["--beat", "--schedule", str(beat_schedule)]
    return argv


def wait_worker_alive(redis_url: str, pid: int, timeout_s: float, check: Callable[[], None]) -> None:
    """Until the worker of process `pid` beats (it is then consuming the queue); `check` raises when it died."""
    client = redis.Redis.from_url(redis_url)
    suffix = f" pid {pid}".encode()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            check()
            try:
                members = cast(list[bytes], client.zrange(keys.pipeline_workers(), 0, -1))
                if any(m.endswith(suffix) for m in members):
                    return
            except redis.RedisError:
                pass  # the stack's redis-server restarting
            time.sleep(0.1)
    finally:
        client.close()
    raise TimeoutError(f"the pipelines worker (pid {pid}) did not start within {timeout_s:g} s")
