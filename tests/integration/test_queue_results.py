"""ResultStore against a real redis-server: put/get, states, wait (immediate, timeout, wake-up, many waiters)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import redis

from loraplex.errors import EngineError, InvalidRequestError, LoraplexError, NotFoundError, error_class, error_name
from loraplex.protocol import Outcome
from loraplex.protocol.results import (
    CreateResult,
    DeleteResult,
    ForwardBackwardResult,
    LoadResult,
    LossFnOutput,
    OptimStepResult,
    SampledSequence,
    SampleResult,
    SaveResult,
)
from loraplex.queue import keys
from loraplex.queue import results as results_module
from loraplex.queue.keys import JobState
from loraplex.queue.results import ResultStore

FB = ForwardBackwardResult((LossFnOutput([-0.5, -1.0]),), {"loss:sum": 1.5, "bad:mean": None})


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
    store.put(Outcome(ok, result=FB))
    store.put(Outcome.failed(bad, EngineError("nan gradients")))
    assert store.get(ok) == Outcome(ok, result=FB)
    assert store.get(bad) == Outcome.failed(bad, EngineError("nan gradients"))
    assert store.state(ok) is JobState.COMPLETE and store.state(bad) is JobState.FAILED
    assert 0 < redis_client.ttl(keys.result_key(ok)) <= 120
    assert 0 < redis_client.ttl(keys.notify_key(ok)) <= 120
    assert store.has_many([ok, _rid()]) == [True, False]


def test_wait_returns_at_once_when_the_result_is_there(redis_client: redis.Redis) -> None:
    store = ResultStore(redis_client)
    rid = _rid()
    store.put(Outcome(rid, result=OptimStepResult({"x": 1.0})))
    started = time.monotonic()
    for _ in range(3):  # repeated waits on the same id
        assert store.wait(rid, timeout_s=5) == Outcome(rid, result=OptimStepResult({"x": 1.0}))
    assert time.monotonic() - started < 0.5


def test_wait_times_out_with_none(redis_client: redis.Redis) -> None:
    store = ResultStore(redis_client)
    started = time.monotonic()
    assert store.wait(_rid(), timeout_s=0.3) is None
    assert 0.25 < time.monotonic() - started < 1.5
    assert store.wait(_rid(), timeout_s=0) is None


def test_several_waiters_all_wake_when_the_result_lands(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_module, "WAIT_SLICE_S", 5.0)  # a waiter the token missed would sleep out the slice
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
        ResultStore(clients[3]).put(Outcome(rid, result=DeleteResult()))
        answers = [f.result(timeout=15) for f in futures]
    assert all(o == Outcome(rid, result=DeleteResult()) for o, _ in answers)
    assert all(waited < 2.0 for _, waited in answers)  # each woken by the notify token, not by its 5 s slice
    assert clients[3].lrange(keys.notify_key(rid), 0, -1) == [b"1"]  # the token stays for later waits
    for c in clients:
        c.close()


def test_owner_and_outcome_and_the_finished_of_one_tenant(redis_client: redis.Redis) -> None:
    """The futures route's reads: a request's owner with its outcome in one call, and the finished outcomes among
    several ids, only the asking tenant's."""
    store = ResultStore(redis_client)
    done, running, foreign, unknown = _rid(), _rid(), _rid(), _rid()
    for rid, owner in ((done, "t1"), (running, "t1"), (foreign, "t2")):
        redis_client.set(keys.request_owner(rid), owner)
    for rid in (done, foreign):
        store.put(Outcome(rid, result=OptimStepResult({"x": 1.0})))
    assert store.owner_and_outcome(done) == ("t1", Outcome(done, result=OptimStepResult({"x": 1.0})))
    assert store.owner_and_outcome(running) == ("t1", None)
    assert store.owner_and_outcome(unknown) == (None, None)
    assert store.finished_of([running, foreign, unknown, done], "t1") == [Outcome(done, result=OptimStepResult({"x": 1.0}))]
    assert store.finished_of([], "t1") == []
    # a long-poll reads the others with the result it woke for
    threading.Timer(0.2, lambda: store.put(Outcome(running, result=DeleteResult()))).start()
    got = store.wait_with_others(running, 5, [done, foreign, unknown], "t1", known_unstored=True)
    assert got == (Outcome(running, result=DeleteResult()), [Outcome(done, result=OptimStepResult({"x": 1.0}))])
    assert store.wait_with_others(unknown, 0.05, [done], "t1") == (None, [Outcome(done, result=OptimStepResult({"x": 1.0}))])


def test_each_result_type_and_error_class_round_trips_with_its_json_form(redis_client: redis.Redis) -> None:
    """What the pool stores is what the gateway reads back: the typed result and the error class; the result's JSON
    form (what the HTTP routes answer) is the same before and after, key order included."""
    store = ResultStore(redis_client)
    sample = SampleResult(
        (SampledSequence([5, 6], [-0.1, -0.2], "stop", [[(5, -0.1)], [(6, -0.2)]]),), [None, -1.5], [None, [(3, -1.5)]]
    )
    saved = SaveResult("tinker://m/weights/a", "state", "a", 3, size_bytes=10, sha256="ab")
    unsized = SaveResult("tinker://m/sampler_weights/b", "sampler", "b", 0)
    for result in (FB, sample, saved, unsized, DeleteResult(), OptimStepResult({"grad_norm:mean": 0.5})):
        rid = _rid()
        store.put(Outcome(rid, result=result))
        got = store.get(rid)
        assert got == Outcome(rid, result=result)
        assert got is not None and got.result is not None
        assert list(got.result.to_wire().items()) == list(result.to_wire().items())
    assert list(saved.to_wire()) == ["path", "kind", "name", "step", "size_bytes", "sha256"]
    assert "size_bytes" not in unsized.to_wire()  # absent, not null, until the files are written
    assert sample.to_wire()["sequences"][0]["topk_logprobs"] == [[[5, -0.1]], [[6, -0.2]]]
    for exc in (NotFoundError("gone"), InvalidRequestError("bad"), EngineError("nan")):
        rid = _rid()
        store.put(Outcome.failed(rid, exc))
        got = store.get(rid)
        assert got is not None and got.error_type is type(exc) and got.error == str(exc)
        assert isinstance(got.exception(), type(exc))


def test_error_classes_travel_by_one_registry() -> None:
    """A class defined outside errors.py travels as the errors.py class it specialises; an unknown name reads as the
    generic class; an exception outside the hierarchy fails its request as an EngineError naming it."""

    class Local(NotFoundError):
        pass

    assert error_name(NotFoundError) == "NotFoundError" and error_class("NotFoundError") is NotFoundError
    assert error_name(Local) == "NotFoundError" and error_name(KeyError) == "LoraplexError"
    assert error_class("NoSuchError") is LoraplexError
    assert Outcome.failed("r", Local("x")) == Outcome("r", error_type=NotFoundError, error="x")
    assert Outcome.failed("r", KeyError("k")) == Outcome("r", error_type=EngineError, error="KeyError: 'k'")


def test_a_result_stored_without_its_type_name_still_reads_typed(redis_client: redis.Redis) -> None:
    """The version before typed results stored the same JSON forms without `result_type`; such a result, still within
    its 24 h time-to-live when the gateway is upgraded, reads back as the type its keys say."""
    store = ResultStore(redis_client)
    load = LoadResult("m", "tinker://m/weights/a", True)
    saved = SaveResult("tinker://m/weights/a", "state", "a", 3, size_bytes=10, sha256="ab")
    sample = SampleResult((SampledSequence([5, 6], [-0.1, -0.2], "stop"),), None, None)
    optim = OptimStepResult({"grad_norm:mean": 0.5})
    for result in (FB, sample, load, saved, optim, CreateResult("m"), DeleteResult()):
        rid = _rid()
        untyped = {"request_id": rid, "result": result.to_wire(), "error_type": None, "error": None}
        redis_client.set(keys.result_key(rid), orjson.dumps(untyped), ex=60)
        assert store.get(rid) == Outcome(rid, result=result), type(result).__name__
    rid = _rid()  # a failure of that version: a null result and the error's name, as today
    old_failure = {"request_id": rid, "result": None, "error_type": "NotFoundError", "error": "gone"}
    redis_client.set(keys.result_key(rid), orjson.dumps(old_failure), ex=60)
    assert store.get(rid) == Outcome(rid, error_type=NotFoundError, error="gone")
