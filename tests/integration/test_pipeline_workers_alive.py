"""The pipelines workers' heartbeats on a real redis-server (queue/pipeline_workers.py, pipelines/heartbeat.py): a
beating worker counts as alive, one that stops cleanly leaves at once, one that stops beating (killed) drops out
three beats later."""

from __future__ import annotations

import time

import redis

from loraplex.pipelines.heartbeat import WorkerHeartbeat
from loraplex.queue import keys, pipeline_workers


def test_workers_count_while_they_beat_and_leave_or_lapse(redis_client: redis.Redis) -> None:
    redis_client.delete(keys.pipeline_workers())
    assert pipeline_workers.alive_count(redis_client) == 0
    clean = WorkerHeartbeat(redis_client, "w1@host pid 1", every_s=0.1).start()  # alive once start returns
    try:
        pipeline_workers.beat(redis_client, "w2@host pid 2", heartbeat_s=0.1)  # one beat, then silence: killed
        assert pipeline_workers.alive_count(redis_client) == 2
    finally:
        clean.stop()
    assert pipeline_workers.alive_count(redis_client) == 1  # left at once
    time.sleep(0.35)  # past three of its beats
    assert pipeline_workers.alive_count(redis_client) == 0


def test_a_live_worker_keeps_beating(redis_client: redis.Redis) -> None:
    redis_client.delete(keys.pipeline_workers())
    beating = WorkerHeartbeat(redis_client, "w3@host pid 3", every_s=0.05).start()
    try:
        time.sleep(0.4)  # many lapse periods: its beats keep it in
        assert pipeline_workers.alive_count(redis_client) == 1
    finally:
        beating.stop()
