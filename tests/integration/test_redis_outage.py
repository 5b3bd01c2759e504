"""Redis killed (SIGKILL) under a running gateway and a running dispatcher, then started again on the same port:
the gateway answers 503 + Retry-After with a JSON error and logs at most a line a second (no tracebacks), the
dispatcher retries quietly, and both resume on their own: nothing accepted is lost (with an append-only Redis, the
plan that ran during the outage gets its result and its entry is acked), and a Redis that comes back empty gets its
consumer group recreated, so new requests run."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.dispatch.hooks import DispatchConfig, PlanHooks
from loraplex.dispatch.loop import Dispatcher
from loraplex.protocol import BatchPlan, Outcome
from loraplex.protocol.results import OptimStepResult
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings
from loraplex.storage.db import migrate
from loraplex.storage.repositories import TenantRepository, unit_of_work
from tests.helpers.services.redis import KillableRedis


@pytest.fixture
def killable(tmp_path: Path) -> Iterator[KillableRedis]:
    with KillableRedis(tmp_path / "redis") as server:
        yield server


def _fb(model: str, seq: int) -> Envelope:
    data = [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0, 1.0]}}]
    payload = {"data": data, "loss_fn": "cross_entropy", "loss_fn_config": {}}
    return Envelope.new(tenant_id="t", model_id=model, seq_id=seq, kind="forward_backward", payload=payload)


def test_gateway_answers_503_with_retry_after_logs_little_and_resumes(
    tmp_path: Path, killable: KillableRedis, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(home=tmp_path, redis_url=killable.url, pool=f"outage-{uuid.uuid4().hex[:6]}", max_rank=16)
    migrate(settings.resolved_database_url)
    app = create_app(settings)
    with TestClient(app) as client:
        with unit_of_work(app.state.services.sessions) as session:
            key = TenantRepository(session).create_tenant("alice")[1]
        alice = {"X-API-Key": key}
        created = client.post("/v1/adapters", json={"rank": 4}, headers=alice)
        assert created.status_code == 202, created.text
        future = f"/v1/futures/{created.json()['request_id']}?timeout=0"
        assert client.get(future, headers=alice).json()["state"] == "queued"

        killable.kill()
        caplog.clear()
        caplog.set_level(logging.WARNING)
        started = time.monotonic()
        answers = []
        while time.monotonic() - started < 2.0:
            answers.append(client.get(future, headers=alice))
            answers.append(client.post("/v1/adapters", json={"rank": 4}, headers=alice))
        elapsed = time.monotonic() - started
        assert len(answers) >= 10
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["type"] == "ServiceUnavailableError" and "redis" in answer.json()["detail"]
        ours = [r for r in caplog.records if r.name.startswith("loraplex")]
        assert 1 <= len(ours) <= elapsed + 2, [r.getMessage() for r in ours]  # at most one line a second
        assert all(r.exc_info is None for r in caplog.records), "no tracebacks"
        health = client.get("/v1/healthz")
        assert health.status_code == 503 and health.json()["redis"]["ok"] is False
        assert any(d.startswith("redis") for d in health.json()["down"])

        killable.start()  # same port, its append-only file: the queued request is still there
        again = client.get(future, headers=alice)
        assert again.status_code == 200 and again.json()["state"] == "queued"
        assert client.post("/v1/adapters", json={"rank": 4}, headers=alice).status_code == 202


class BlockingExecutor:
    """Answers every request ok; the first plan waits for `go` (so the test can kill Redis while it runs)."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.applied: list[tuple[str, int]] = []

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        self.entered.set()
        self.go.wait(30)
        self.applied += [(r.model_id, r.seq_id) for r in plan.requests]
        return [Outcome(r.request_id, result=OptimStepResult({"seq": r.seq_id})) for r in plan.requests]


def _wait_result(results: ResultStore, request_id: str, limit_s: float = 30.0) -> Outcome:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            outcome = results.get(request_id)
        except redis.ConnectionError:
            outcome = None
        if outcome is not None:
            return outcome
        time.sleep(0.05)
    raise AssertionError(f"no result for {request_id} after {limit_s} s")


def test_dispatcher_rides_out_redis_restarts_and_loses_nothing(
    killable: KillableRedis, caplog: pytest.LogCaptureFixture
) -> None:
    pool, model = f"p-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(killable.url)
    executor = BlockingExecutor()
    config = DispatchConfig.from_settings(Settings(), pipelined=True, coalesce_s=0.0, block_ms=50)
    dispatcher = Dispatcher(client, pool, executor, config, PlanHooks(applied_seq_lookup=lambda m: 0))
    stop = threading.Event()
    runner = threading.Thread(target=dispatcher.run_forever, args=(stop,), daemon=True)
    runner.start()
    try:
        producer, results = Producer(client, pool), ResultStore(client)
        first = producer.submit(_fb(model, 1))
        assert executor.entered.wait(10)
        caplog.clear()  # before the kill: the reader may log the outage at once, and then holds its next line 5 s
        caplog.set_level(logging.WARNING)
        for name, logger in logging.root.manager.loggerDict.items():  # a logging config another test in this
            if name.startswith("loraplex") and isinstance(logger, logging.Logger):  # process loaded may have
                logger.disabled = False  # disabled the loggers made before it; these lines are what is checked
        killable.kill()  # while the plan runs: its result has nowhere to go yet
        executor.go.set()
        time.sleep(2.5)  # the finisher and the reader retry meanwhile
        killable.start()  # append-only: the stream, the group and the pending entry are back
        assert _wait_result(results, first).result == OptimStepResult({"seq": 1})
        stream = keys.request_stream(pool, "t")
        deadline = time.monotonic() + 10
        while client.xlen(stream) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.xlen(stream) == 0  # acked once the result was stored
        second = producer.submit(_fb(model, 2))
        assert _wait_result(results, second).result == OptimStepResult({"seq": 2})
        ours = [r for r in caplog.records if r.name.startswith("loraplex")]
        assert 1 <= len(ours) <= 6, [r.getMessage() for r in ours]  # a few lines, not one per retry
        assert all(r.exc_info is None for r in ours)

        killable.kill()  # and once more, coming back EMPTY: the consumer group must be made again
        killable.wipe()
        time.sleep(1.0)
        killable.start(persistent=False)
        third = producer.submit(_fb(model, 3))
        assert _wait_result(results, third).result == OptimStepResult({"seq": 3})
        assert executor.applied == [(model, 1), (model, 2), (model, 3)]  # each applied once, in order
    finally:
        stop.set()
        runner.join(timeout=20)
        client.close()


class ResultsFailingOnce(ResultStore):
    """The stored-result check fails once with a ConnectionError, as when Redis dies between the dispatcher's read
    and its check: a moment no real kill can be timed to hit, so this fault is injected (the only stand-in here)."""

    def __init__(self, redis_client: redis.Redis) -> None:
        super().__init__(redis_client)
        self.failed = False

    def has_many(self, request_ids: list[str]) -> list[bool]:
        if request_ids and not self.failed:
            self.failed = True
            raise redis.ConnectionError("Connection closed by server.")
        return super().has_many(request_ids)


@pytest.mark.parametrize("pipelined", [True, False])
def test_entries_read_when_a_redis_call_failed_run_at_once_not_after_the_stale_claim(
    tmp_path: Path, pipelined: bool
) -> None:
    """The dispatcher read two requests, then its next Redis call failed: the entries stay pending to it, and it
    reads them again after the error (`Consumer.rescan_pending`), so both run within a second or two instead of
    waiting for the 30 s stale-entry claim; each once, in order."""
    with KillableRedis(tmp_path / "redis", persistent=False) as server:
        pool, model = f"p-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
        client = redis.Redis.from_url(server.url)
        executor = BlockingExecutor()
        executor.go.set()
        config = DispatchConfig.from_settings(Settings(), pipelined=pipelined, coalesce_s=0.0, block_ms=50)
        assert config.claim_idle_ms >= 30_000
        failing = ResultsFailingOnce(client)
        hooks = PlanHooks(applied_seq_lookup=lambda m: 0, results=failing)
        dispatcher = Dispatcher(client, pool, executor, config, hooks)
        stop = threading.Event()
        runner = threading.Thread(target=dispatcher.run_forever, args=(stop,), daemon=True)
        runner.start()
        try:
            producer, results = Producer(client, pool), ResultStore(client)
            ids = [producer.submit(_fb(model, 1)), producer.submit(_fb(model, 2))]
            for request_id in ids:
                assert _wait_result(results, request_id, limit_s=5.0).ok
            assert failing.failed  # the fault did happen
            assert executor.applied == [(model, 1), (model, 2)]
        finally:
            stop.set()
            runner.join(timeout=20)
            client.close()
