"""Faults under a running embedded stack of its own (heartbeat every 0.5 s, so a dead pool shows in 1.5 s): healthz
turns 200 only once the pool has loaded its model; redis-server killed -> every route 503 + Retry-After, a bounded
log, and after redis-server restarts on the same port the gateway and the pool resume (a new step completes);
the pool SIGKILLed -> healthz 503, pending futures say paused_capacity, and the client's result() times out with
FutureTimeoutError naming it. The tests run in this order (the last one kills the pool). This stack does not restart
its children (`supervise=False`): it shows what a dead pool looks like from outside; tests/e2e/test_recovery.py has
the supervised stack, where a killed pool comes back with its adapters."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from loraplex.client import Datum, ServiceClient
from loraplex.errors import FutureTimeoutError
from loraplex.launch.embedded import Stack, ready_file
from loraplex.runtime.netutil import free_port
from loraplex.runtime.redis_child import RedisChild
from loraplex.settings import Settings
from tests.helpers.stack import create_tenants

DATA = [Datum.for_next_token([1, 2, 3, 4, 5])]


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[httpx.Response]]]:
    """The stack, and every healthz answer seen while it started (polled from another thread)."""
    home = tmp_path_factory.mktemp("faults")
    stack = Stack(Settings(home=home, slots=4, max_rank=16, pool_heartbeat_seconds=0.5, supervise=False),
                  api_port=free_port())  # fmt: skip
    seen: list[tuple[httpx.Response, bool]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                answer = httpx.get(f"{stack.base_url}/v1/healthz", timeout=2)
                seen.append((answer, ready_file(stack.settings).exists()))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stack.start()
        deadline = time.monotonic() + 10  # the watcher's own first 200 (its poll in flight may predate readiness)
        while not any(answer.status_code == 200 for answer, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        watcher.join(5)
        assert all(ready for answer, ready in seen if answer.status_code == 200)
        yield stack, [answer for answer, _ in seen]
    finally:
        done.set()
        stack.stop()


def test_healthz_is_200_only_once_the_pool_has_loaded(watched) -> None:
    stack, seen = watched
    codes = [a.status_code for a in seen]
    assert 503 in codes and codes[-1] == 200, codes  # the gateway answered before the pool was ready
    assert codes.index(200) > codes.index(503)
    for early in (a for a in seen if a.status_code == 503):
        assert early.json()["redis"]["ok"] and early.json()["database"]["ok"]
        assert any(w in early.json()["down"][0] for w in ("loading its base model", "never sent a heartbeat")), early.json()
    body = httpx.get(f"{stack.base_url}/v1/healthz").json()
    (pool,) = body["pools"]
    assert body["status"] == "ok" and pool["state"] == "ready" and pool["heartbeat_age_s"] < 1.5


def _lines(path: os.PathLike[str]) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def test_redis_killed_and_restarted_under_the_stack(watched) -> None:
    stack, _ = watched
    key = create_tenants(stack, "redis-outage")["redis-outage"]
    with ServiceClient(stack.base_url, key) as client:
        tc = client.create_lora_training_client(rank=4)
        tc.forward_backward(DATA).result(timeout=60)
        tc.optim_step().result(timeout=60)
        assert stack.redis is not None
        old = stack.redis
        api_log, pool_log = stack.log_dir / "api.log", stack.log_dir / "pool.log"
        api_before, pool_before = _lines(api_log), _lines(pool_log)

        old.kill()
        headers = {"X-API-Key": key}
        body = {"seq_id": 3, "data": [d.to_json() for d in DATA]}
        started = time.monotonic()
        answers = []
        while time.monotonic() - started < 3.0:
            answers.append(httpx.post(f"{stack.base_url}/v1/adapters/{tc.model_id}/forward_backward", json=body,
                                      headers=headers, timeout=10))  # fmt: skip
            answers.append(httpx.get(f"{stack.base_url}/v1/healthz", timeout=10))
        elapsed = time.monotonic() - started
        assert len(answers) >= 10
        for answer in answers:
            assert answer.status_code == 503, answer.text
        assert all(a.headers["retry-after"] == "1" for a in answers[::2])
        assert answers[0].json()["type"] == "ServiceUnavailableError"
        assert answers[1].json()["redis"]["ok"] is False
        workers = stack.settings.resolved_api_workers
        assert _lines(api_log) - api_before <= (elapsed + 2) * workers  # one line a second at most, no tracebacks

        # same port, empty: a Redis that lost everything (no persistence), the worst case (test_recovery.py: with AOF)
        stack.redis = RedisChild(port=old.port, workdir=old.workdir, persist=False).start()
        assert httpx.get(f"{stack.base_url}/v1/healthz", timeout=10).status_code == 200
        again = client.training_client(tc.model_id)  # seq_ids from the adapter's applied one (SQL)
        out = again.forward_backward(DATA).result(timeout=60)  # the pool recreated its group and read it
        assert out["metrics"]["loss:sum"] > 0
        again.optim_step().result(timeout=60)
        assert _lines(pool_log) - pool_before <= 12  # a few rate-limited lines, not one per retry


def test_a_killed_pool_makes_healthz_503_and_futures_paused(watched) -> None:
    stack, _ = watched
    key = create_tenants(stack, "pool-dies")["pool-dies"]
    with ServiceClient(stack.base_url, key, result_timeout=4.0) as client:
        tc = client.create_lora_training_client(rank=4)
        pool = stack.children[0]
        os.kill(pool.pid, signal.SIGKILL)
        pool.wait(10)
        time.sleep(stack.settings.pool_stale_seconds + 0.5)

        health = httpx.get(f"{stack.base_url}/v1/healthz", timeout=10)
        assert health.status_code == 503 and "no heartbeat for" in health.json()["down"][0], health.text

        future = tc.forward_backward(DATA)  # accepted (queued in Redis), but nobody runs it
        raw = httpx.get(f"{stack.base_url}/v1/futures/{future.request_id}", params={"timeout": 0},
                        headers={"X-API-Key": key}).json()  # fmt: skip
        assert raw["state"] == "queued" and raw["queue_state"] == "paused_capacity"
        assert "no heartbeat for" in raw["queue_state_reason"]
        started = time.monotonic()
        with pytest.raises(FutureTimeoutError, match="paused_capacity: pool default paused: no heartbeat") as info:
            future.result()  # the client's result_timeout (4 s here; 15 minutes by default)
        assert 3.5 < time.monotonic() - started < 10
        assert info.value.request_id == future.request_id and info.value.queue_state == "paused_capacity"
        assert future.request_id in str(info.value) and isinstance(info.value, TimeoutError)
