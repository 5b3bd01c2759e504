"""ResultStore against a real redis-server: put/get, states, wait (immediate, timeout, wake-up, many waiters)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import redis

from loraplex.protocol import Outcome
from loraplex.queue import keys
from loraplex.queue.keys import JobState
from loraplex.queue.results import ResultStore


def _rid() -> str:
    return uuid.uuid4().hex


def test_put_get_and_states(redis_client: redis.Redis) -> None:
    store = ResultStore(redis_client, ttl_s=120)
    ok, bad = _rid(), _rid()
    assert store.get(ok) is None and store.state(ok) is None
    store.set_state(ok, JobState.QUEUED)
    assert store.state(ok) is JobState.QUEUED
    store.set_state(ok, JobState.RUNNING)
    assert store.state(ok) is JobState.RUNNING
    store.put(Outcome(ok, result={"loss": 1.5, "metrics": {"loss:sum": 1.5}}))
    store.put(Outcome(bad, error_type="EngineError", error="nan gradients"))
    assert store.get(ok) == Outcome(ok, result={"loss": 1.5, "metrics": {"loss:sum": 1.5}})
    assert store.get(bad) == Outcome(bad, error_type="EngineError", error="nan gradients")
    assert store.state(ok) is JobState.COMPLETE and store.state(bad) is JobState.FAILED
    assert 0 < redis_client.ttl(keys.result_key(ok)) <= 120
    assert 0 < redis_client.ttl(keys.notify_key(ok)) <= 120
    assert store.has_many([ok, _rid()]) == [True, False]


def test_wait_returns_at_once_when_the_result_is_there(redis_client: redis.Redis) -> None:
    store = ResultStore(redis_client)
    rid = _rid()
    store.put(Outcome(rid, result={"x": 1}))
    started = time.monotonic()
    for _ in range(3):  # repeated waits on the same id
        assert store.wait(rid, timeout_s=5) == Outcome(rid, result={"x": 1})
    assert time.monotonic() - started < 0.5


def test_wait_times_out_with_none(redis_client: redis.Redis) -> None:
    store = ResultStore(redis_client)
    started = time.monotonic()
    assert store.wait(_rid(), timeout_s=0.3) is None
    assert 0.25 < time.monotonic() - started < 1.5
    assert store.wait(_rid(), timeout_s=0) is None


def test_several_waiters_all_wake_when_the_result_lands(redis_url: str) -> None:
    rid = _rid()
    clients = [redis.Redis.from_url(redis_url) for _ in range(4)]
    barrier = threading.Barrier(4)

    def waiter(client: redis.Redis) -> tuple[Outcome | None, float]:
        barrier.wait()
        t0 = time.monotonic()
        return ResultStore(client).wait(rid, timeout_s=10), time.monotonic() - t0

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(waiter, c) for c in clients[:3]]
        barrier.wait()
        time.sleep(0.2)
        ResultStore(clients[3]).put(Outcome(rid, result={"done": True}))
        answers = [f.result(timeout=15) for f in futures]
    assert all(o == Outcome(rid, result={"done": True}) for o, _ in answers)
    assert all(waited < 2.0 for _, waited in answers)  # woken by the notify list, not by the 10 s timeout
    for c in clients:
        c.close()
