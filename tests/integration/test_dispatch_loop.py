"""The dispatcher loop end to end on a real redis-server, with a small arithmetic engine standing in for the workers
(the real engine is built elsewhere; this one only has to make the order of application visible in its numbers)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import redis

from loraplex.dispatch.hooks import AnsweredPlan, DispatchConfig, FinishStep, PlanHooks
from loraplex.dispatch.loop import Dispatcher
from loraplex.protocol import BatchPlan, Outcome, RequestKind, StepKind
from loraplex.protocol.results import DeleteResult, ForwardBackwardResult, OptimStepResult, Result
from loraplex.queue import keys, replay_log, request_traces
from loraplex.queue import stats as plan_stats
from loraplex.queue.envelope import Envelope, encode
from loraplex.queue.keys import JobState
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings
from tests.helpers.finish import Recording
from tests.helpers.queued import queue_length


def _typed(kind: RequestKind, numbers: dict[str, float]) -> Result:
    """The arithmetic engine's numbers as its kind's result: a forward's in its metrics, a delete's none, and those of
    a create or an optim_step (the adapter's w) as an update's metrics."""
    if kind in (RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD):
        return ForwardBackwardResult(metrics=dict(numbers))
    if kind == RequestKind.DELETE_ADAPTER:
        return DeleteResult()
    return OptimStepResult(metrics=dict(numbers))


def _metrics(outcome: Outcome | None) -> dict[str, Any]:
    """The numbers an outcome of the arithmetic engine carries."""
    assert outcome is not None and outcome.result is not None, outcome
    return outcome.result.to_wire().get("metrics", {})


class ArithmeticEngine:
    """Each adapter is a weight w and a gradient g. forward_backward adds w * sum(tokens) to g; optim_step does
    w -= lr * g and clears g. Applying steps in another order, or twice, gives other numbers."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.adapters: dict[str, dict[str, float]] = {m: {"w": w, "g": 0.0} for m, w in (weights or {}).items()}
        self.applied: list[tuple[str, int, str]] = []
        self.plans: list[BatchPlan] = []

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        self.plans.append(plan)
        outcomes = []
        for step in plan.steps:
            for r in step.requests:
                self.applied.append((r.model_id, r.seq_id, str(r.kind)))
                numbers = self._apply(r.model_id, r.kind, r.payload)
                outcomes.append(Outcome(r.request_id, result=_typed(r.kind, numbers)))
        return outcomes

    def _apply(self, model: str, kind: RequestKind, payload: Any) -> dict[str, Any]:  # the kind's payload model
        if kind == RequestKind.CREATE_ADAPTER:
            self.adapters[model] = {"w": float(payload.seed), "g": 0.0}
            return {"w": self.adapters[model]["w"]}
        if kind == RequestKind.DELETE_ADAPTER:
            self.adapters.pop(model)
            return {}
        a = self.adapters[model]
        if kind == RequestKind.OPTIM_STEP:
            a["w"] -= payload.adam_params["learning_rate"] * a["g"]
            a["g"] = 0.0
            return {"w": a["w"]}
        total = sum(sum(d.model_input) for d in payload.data)
        if kind == RequestKind.FORWARD_BACKWARD:
            a["g"] += a["w"] * total
        return {"loss": a["w"] * total}


def _fb(model: str, seq: int, tokens: list[int]) -> Envelope:
    data = [{"model_input": tokens, "loss_fn_inputs": {"target_tokens": tokens, "weights": [1.0] * len(tokens)}}]
    payload = {"data": data, "loss_fn": "cross_entropy", "loss_fn_config": {}}
    return Envelope.new(tenant_id=f"t-{model}", model_id=model, seq_id=seq, kind="forward_backward", payload=payload)


def _opt(model: str, seq: int, lr: float = 0.1) -> Envelope:
    adam = {"learning_rate": lr, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    return Envelope.new(
        tenant_id=f"t-{model}", model_id=model, seq_id=seq, kind="optim_step", payload={"adam_params": adam}
    )


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _drain(d: Dispatcher, results: ResultStore, request_ids: list[str], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not all(results.has_many(request_ids)):
        assert time.monotonic() < deadline, "requests were not answered"
        d.run_once()


@pytest.fixture
def settings() -> Settings:
    return Settings(plan_tokens=4096)


def test_two_adapters_submitted_out_of_order_are_applied_in_seq_order(
    redis_client: redis.Redis, settings: Settings
) -> None:
    pool, a, b = _uid(), f"a-{_uid()}", f"b-{_uid()}"
    engine = ArithmeticEngine({a: 1.0, b: 2.0})
    recorded: dict[str, int] = {a: 0, b: 0}  # "SQL": the last applied seq per adapter

    def on_outcomes(outcomes: list[Outcome], plan: BatchPlan) -> None:
        by_id = {r.request_id: r for r in plan.requests}
        for o in outcomes:
            r = by_id[o.request_id]
            recorded[r.model_id] = max(recorded[r.model_id], r.seq_id)

    d = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20),
                   PlanHooks(finish=Recording(on_outcomes), applied_seq_lookup=recorded.get))  # fmt: skip
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    late = [_opt(a, 2), _opt(b, 2), _fb(b, 3, [5])]
    ids = [producer.submit(e) for e in late]
    for _ in range(3):
        d.run_once()
    assert engine.applied == []  # everyone waits for seq 1
    assert [results.state(i) for i in ids] == [JobState.QUEUED] * 3

    first = [_fb(a, 1, [1, 2]), _fb(b, 1, [3])]
    ids += [producer.submit(e) for e in first]
    _drain(d, results, ids)

    assert [x for x in engine.applied if x[0] == a] == [(a, 1, "forward_backward"), (a, 2, "optim_step")]
    assert [(m, s) for m, s, _ in engine.applied if m == b] == [(b, 1), (b, 2), (b, 3)]
    # Coalesced: both adapters' forward_backward in one step, both optim_steps in the next.
    first_plan = engine.plans[0]
    assert [(s.kind, sorted(r.model_id for r in s.requests)) for s in first_plan.steps[:2]] == [
        (StepKind.FORWARD_BACKWARD, sorted([a, b])),
        (StepKind.OPTIM_STEP, sorted([a, b])),
    ]
    # The numbers: a: g = 1*3, w = 1 - 0.1*3 = 0.7. b: g = 2*3, w = 2 - 0.6 = 1.4, then loss = 1.4*5.
    assert _metrics(results.get(ids[0])) == pytest.approx({"w": 0.7})
    assert _metrics(results.get(ids[1])) == pytest.approx({"w": 1.4})
    assert _metrics(results.get(ids[2])) == pytest.approx({"loss": 7.0})
    assert all(results.state(i) is JobState.COMPLETE for i in ids)
    assert recorded == {a: 2, b: 3} and d.last_applied(b) == 3
    assert queue_length(redis_client, pool) == 0  # everything acked and deleted


def test_a_duplicate_submission_is_applied_once(redis_client: redis.Redis, settings: Settings) -> None:
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    d = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20),
                   PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    stream = keys.request_stream(pool, f"t-{a}")

    first = _fb(a, 1, [4])
    assert producer.submit(first) == first.request_id
    assert producer.submit(_fb(a, 1, [4])) == first.request_id  # a client retry: nothing enqueued
    # Something that bypassed the producer's idempotency: a second request_id for the same (model_id, seq_id).
    rogue = _fb(a, 1, [4])
    redis_client.xadd(stream, encode(rogue))
    _drain(d, results, [first.request_id, rogue.request_id])
    # Once more after it was applied (seq 1 <= last applied).
    late = _fb(a, 1, [4])
    redis_client.xadd(stream, encode(late))
    _drain(d, results, [late.request_id])

    assert engine.applied == [(a, 1, "forward_backward")]
    expected = Outcome(first.request_id, result=ForwardBackwardResult(metrics={"loss": 4.0}))
    assert results.get(first.request_id) == expected
    for dup in (rogue, late):
        assert results.get(dup.request_id) == Outcome(dup.request_id, result=ForwardBackwardResult(metrics={"loss": 4.0}))
    assert redis_client.xlen(stream) == 0


def test_create_steps_delete_in_one_plan_and_results_reach_a_waiting_client(
    redis_client: redis.Redis, settings: Settings
) -> None:
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine()
    reports: list[tuple[list[Outcome], BatchPlan]] = []
    d = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20),
                   PlanHooks(finish=Recording(lambda o, p: reports.append((o, p)))))  # fmt: skip
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    envs = [
        Envelope.new(tenant_id="t", model_id=a, kind="delete_adapter"),
        _fb(a, 1, [2]),
        Envelope.new(tenant_id="t", model_id=a, kind="create_adapter", payload={"seed": 3, "rank": 4}),
        _opt(a, 2, lr=0.5),
    ]
    ids = [producer.submit(e) for e in envs]

    stop = threading.Event()
    worker = threading.Thread(target=d.run_forever, args=(stop,))
    worker.start()
    try:
        outcomes = [results.wait(i, timeout_s=10) for i in ids]
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert [_metrics(o) for o in outcomes] == [{}, {"loss": 6.0}, {"w": 3.0}, {"w": 0.0}]  # w = 3 - 0.5 * (3*2)
    assert [(s, k) for _, s, k in engine.applied] == [
        (-1, "create_adapter"),
        (1, "forward_backward"),
        (2, "optim_step"),
        (-1, "delete_adapter"),
    ]
    assert [o.request_id for o, _ in ((o, p) for os, p in reports for o in os)] == [ids[2], ids[1], ids[3], ids[0]]


def test_a_seq_gap_fails_after_the_timeout_naming_the_missing_seq(
    redis_client: redis.Redis, settings: Settings
) -> None:
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    reports: list[tuple[list[Outcome], BatchPlan]] = []
    d = Dispatcher(
        redis_client,
        pool,
        engine,
        DispatchConfig.from_settings(settings, seq_gap_timeout_s=0.3, block_ms=20),
        PlanHooks(finish=Recording(lambda o, p: reports.append((o, p))), applied_seq_lookup=lambda m: 1),
    )
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    stuck = [producer.submit(_fb(a, 3, [1])), producer.submit(_opt(a, 4))]
    started = time.monotonic()
    _drain(d, results, stuck)
    assert time.monotonic() - started >= 0.3
    for rid in stuck:
        outcome = results.get(rid)
        assert outcome.error_name == "InvalidRequestError" and "seq_id 2" in outcome.error
    assert engine.applied == []
    [(outs, plan)] = reports  # reported, so the caller records seq 4 as answered
    assert {r.seq_id for r in plan.requests} == {3, 4} and not any(o.ok for o in outs)
    # The adapter moved past the gap: seq 5 applies; the late seq 2 gets an answer, never applied.
    nxt, late = _fb(a, 5, [2]), _fb(a, 2, [9])
    producer.submit(nxt)
    producer.submit(late)
    _drain(d, results, [nxt.request_id, late.request_id])
    assert _metrics(results.get(nxt.request_id)) == {"loss": 2.0}
    assert results.get(late.request_id).error_name == "ConflictError"
    assert engine.applied == [(a, 5, "forward_backward")]


def test_a_restarted_dispatcher_finishes_what_the_crashed_one_read(
    redis_client: redis.Redis, settings: Settings
) -> None:
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    recorded: dict[str, int] = {a: 0}

    class Crash(BaseException):
        pass

    def record(outcomes: list[Outcome], plan: BatchPlan) -> None:
        for r in plan.requests:
            recorded[r.model_id] = max(recorded[r.model_id], r.seq_id)

    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    ids = [producer.submit(_fb(a, 1, [1])), producer.submit(_opt(a, 2))]
    first = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings),
                       PlanHooks(finish=Recording(record), applied_seq_lookup=recorded.get))  # fmt: skip

    def crash_before_acking(stream_ids: Any) -> None:
        if list(stream_ids):
            raise Crash  # recorded in SQL and results stored; nothing acked yet

    first.consumer.ack = crash_before_acking  # type: ignore[method-assign]
    with pytest.raises(Crash):
        first.run_once()
    assert all(results.has_many(ids)) and queue_length(redis_client, pool) == 2
    ids.append(producer.submit(_fb(a, 3, [1])))

    second = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings),
                        PlanHooks(applied_seq_lookup=recorded.get))  # fmt: skip
    _drain(second, results, ids)
    assert [s for _, s, _ in engine.applied] == [1, 2, 3]  # 1 and 2 not applied again
    assert _metrics(results.get(ids[2])) == pytest.approx({"loss": 0.9})  # w = 1 - 0.1 * 1
    assert queue_length(redis_client, pool) == 0


def test_answered_requests_move_to_the_request_log_and_a_recovered_adapter_reruns_an_unacked_one_silently(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """request_log: each answered entry leaves its stream for its adapter's log (queue/replay_log.py) in the ack. A
    crash after the results were stored but before the ack; the restarted pool rebuilt the adapter up to before
    those requests (seed_applied): they run again for their state, their stored results are not sent again (no new
    notify token, state still complete), and they are logged once they are acked."""
    pool, a = _uid(), f"a-{_uid()}"
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    ids = [producer.submit(_fb(a, 1, [1])), producer.submit(_opt(a, 2))]
    first = Dispatcher(redis_client, pool, ArithmeticEngine({a: 1.0}), DispatchConfig.from_settings(settings),
                       PlanHooks(request_log=True))  # fmt: skip

    class Crash(BaseException):
        pass

    def crash_before_acking(stream_ids: Any, log: Any = None) -> None:
        if list(stream_ids):
            raise Crash

    first.consumer.ack = crash_before_acking  # type: ignore[method-assign]
    with pytest.raises(Crash):
        first.run_once()
    first_results = [results.get(i) for i in ids]
    assert replay_log.read_after(redis_client, pool, a, None) == []  # nothing acked: nothing logged yet

    engine = ArithmeticEngine({a: 1.0})  # the adopted state: before seq 1
    second = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings), PlanHooks(request_log=True))
    second.seed_applied({a: None})
    ids.append(producer.submit(_fb(a, 3, [1])))
    _drain(second, results, ids)
    assert [s for _, s, _ in engine.applied] == [1, 2, 3]  # rerun for the state, then the new one
    assert [results.get(i) for i in ids[:2]] == first_results
    assert [redis_client.llen(keys.notify_key(i)) for i in ids] == [1, 1, 1]  # delivered once each
    assert all(redis_client.get(keys.state_key(i)) == b"complete" for i in ids)
    assert _metrics(results.get(ids[2])) == pytest.approx({"loss": 0.9})  # w = 1 - 0.1 * 1: seq 1 and 2 each once
    logged = replay_log.read_after(redis_client, pool, a, None)
    assert [(e.seq_id, e.apply, e.envelope.request_id) for e in logged] == [(1, True, ids[0]), (2, True, ids[1]),
                                                                            (3, True, ids[2])]  # fmt: skip
    assert queue_length(redis_client, pool) == 0
    replay_log.trim(redis_client, pool, a, 2)
    assert [e.seq_id for e in replay_log.read_after(redis_client, pool, a, None)] == [3]
    assert a in replay_log.logged_adapters(redis_client, pool)
    delete = producer.submit(Envelope.new(tenant_id=f"t-{a}", model_id=a, kind="delete_adapter"))
    _drain(second, results, [delete])
    second.run_once()
    assert replay_log.read_after(redis_client, pool, a, None) == [] and a not in replay_log.logged_adapters(
        redis_client, pool
    )  # a delete drops the log


def test_entries_of_a_dead_dispatcher_are_claimed(redis_client: redis.Redis, settings: Settings) -> None:
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    ids = [producer.submit(_fb(a, 1, [1]))]

    class Crash(BaseException):
        pass

    class DyingEngine:
        def execute(self, plan: BatchPlan) -> list[Outcome]:
            raise Crash

    dead = Dispatcher(redis_client, pool, DyingEngine(), DispatchConfig.from_settings(settings, consumer_name="node-1"))
    with pytest.raises(Crash):
        dead.run_once()
    time.sleep(0.1)
    live = Dispatcher(redis_client, pool, engine,
                      DispatchConfig.from_settings(settings, consumer_name="node-2", claim_idle_ms=50))  # fmt: skip
    _drain(live, results, ids)
    assert _metrics(results.get(ids[0])) == {"loss": 1.0}


def test_an_engine_failure_fails_the_plan_and_the_adapter_moves_on(
    redis_client: redis.Redis, settings: Settings
) -> None:
    pool, a = _uid(), f"a-{_uid()}"

    class Flaky(ArithmeticEngine):
        def execute(self, plan: BatchPlan) -> list[Outcome]:
            if any(r.seq_id == 1 for r in plan.requests):
                raise RuntimeError("worker rank 3 died")
            return super().execute(plan)

    engine = Flaky({a: 1.0})
    d = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20),
                   PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    bad = producer.submit(_fb(a, 1, [1]))
    _drain(d, results, [bad])
    assert results.get(bad).error_name == "EngineError" and "rank 3 died" in results.get(bad).error
    assert results.state(bad) is JobState.FAILED
    good = producer.submit(_fb(a, 2, [2]))
    _drain(d, results, [good])
    assert _metrics(results.get(good)) == {"loss": 2.0}


def test_a_restart_that_claims_its_own_backlog_keeps_each_entry_once(
    redis_client: redis.Redis, settings: Settings
) -> None:
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    waiting = producer.submit(_fb(a, 3, [1]))  # behind a gap: stays in the buffer
    d = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20),
                   PlanHooks(applied_seq_lookup=lambda m: 1))  # fmt: skip
    d.run_once()
    time.sleep(0.1)
    # Same name after a restart, claiming idle entries at once: claim and backlog both return the entry.
    again = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20, claim_idle_ms=50),
                       PlanHooks(applied_seq_lookup=lambda m: 1))  # fmt: skip
    again.run_once()
    assert [r.request_id for r in again.pending] == [waiting]
    nxt = producer.submit(_fb(a, 2, [1]))
    _drain(again, results, [waiting, nxt])
    assert [s for _, s, _ in engine.applied] == [2, 3]


def test_pipelined_closed_loop_tenants_share_steps_and_every_step_applies_once_in_order(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """The pool's mode: prefetch + background finisher + coalescing. Four tenants each send forward_backward +
    optim_step, await both, repeat (a training loop): every step is applied once, in seq order, the numbers are the
    arithmetic engine's, and plans mix the tenants (not one tenant per plan, as arrival order alone would make them)."""
    pool = _uid()
    models = [f"m{i}-{_uid()}" for i in range(4)]
    weights = {m: 1.0 + i for i, m in enumerate(models)}
    engine = ArithmeticEngine(dict(weights))
    recorded: dict[str, int] = dict.fromkeys(models, 0)

    class SlowEngine:  # a step that takes GPU-like time, so arrivals during it are read ahead
        def execute(self, plan: BatchPlan) -> list[Outcome]:
            time.sleep(0.02)
            return engine.execute(plan)

    def on_outcomes(outcomes: list[Outcome], plan: BatchPlan) -> None:
        for r in plan.requests:
            recorded[r.model_id] = max(recorded[r.model_id], r.seq_id)

    d = Dispatcher(redis_client, pool, SlowEngine(),
                   DispatchConfig.from_settings(settings, block_ms=20, pipelined=True, coalesce_s=0.2),
                   PlanHooks(finish=Recording(on_outcomes), applied_seq_lookup=recorded.get))  # fmt: skip
    stop = threading.Event()
    loop = threading.Thread(target=d.run_forever, args=(stop,))
    loop.start()
    steps, lr = 6, 0.01
    finals: dict[str, Any] = {}

    def tenant(m: str) -> None:
        producer, results = Producer(redis_client, pool), ResultStore(redis_client)
        for k in range(steps):
            fb, opt = producer.submit(_fb(m, 2 * k + 1, [1, 1])), producer.submit(_opt(m, 2 * k + 2, lr))
            assert results.wait(fb, 10) is not None
            finals[m] = results.wait(opt, 10)

    tenants = [threading.Thread(target=tenant, args=(m,)) for m in models]
    try:
        for t in tenants:
            t.start()
        for t in tenants:
            t.join(timeout=60)
    finally:
        stop.set()
        loop.join(timeout=10)
    for m in models:
        assert [s for mm, s, _ in engine.applied if mm == m] == list(range(1, 2 * steps + 1))
        w = weights[m]
        for _ in range(steps):  # g = 2 w, w -= lr * g
            w -= lr * 2 * w
        assert _metrics(finals[m]) == pytest.approx({"w": w})
        assert recorded[m] == 2 * steps  # the finisher wrote every plan's records before close() returned
    fb_steps = [s for p in engine.plans for s in p.steps if s.kind == StepKind.FORWARD_BACKWARD]
    assert sum(len(s.requests) for s in fb_steps) / len(fb_steps) >= 3.0  # tenants coalesced
    assert queue_length(redis_client, pool) == 0  # everything acked


def test_a_plan_of_two_rounds_answers_the_first_before_the_second_runs(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """A tenant that sends its next step before awaiting the last (two steps queued: one plan, two rounds) has the
    first step's results stored while the second round runs, so its step after that is back before the plan ends."""
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    results = ResultStore(redis_client)
    stored_before_round: list[bool] = []
    ids: list[str] = []

    class WatchingEngine:  # each round waits (a bounded while) for the first round's results to be stored
        def execute(self, plan: BatchPlan) -> list[Outcome]:
            deadline = time.monotonic() + 3.0
            while engine.plans and not all(results.has_many(ids[:2])) and time.monotonic() < deadline:
                time.sleep(0.01)
            stored_before_round.append(all(results.has_many(ids[:2])))
            return engine.execute(plan)

    d = Dispatcher(redis_client, pool, WatchingEngine(),
                   DispatchConfig.from_settings(settings, block_ms=20, pipelined=True, answer_rounds=True),
                   PlanHooks(finish=Recording(lambda o, p: None)))  # fmt: skip
    producer = Producer(redis_client, pool)
    ids += [producer.submit(e) for e in (_fb(a, 1, [1]), _opt(a, 2), _fb(a, 3, [1]), _opt(a, 4))]
    try:
        d.run_once()  # one plan: the policy chains the adapter's four requests into two rounds
    finally:
        d.close()
    assert [[(s.kind, [r.seq_id for r in s.requests]) for s in p.steps] for p in engine.plans] == [
        [(StepKind.FORWARD_BACKWARD, [1]), (StepKind.OPTIM_STEP, [2])],
        [(StepKind.FORWARD_BACKWARD, [3]), (StepKind.OPTIM_STEP, [4])],
    ]
    assert stored_before_round == [False, True]
    assert all(results.has_many(ids)) and plan_stats.read(redis_client, pool).plans == 1


def test_a_plan_of_two_rounds_is_answered_whole_without_answer_rounds(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """The CPU pools' mode (settings.answer_rounds unset there): the plan runs in one executor call, answered at its
    end, so the clients' next requests do not take the cores from the engine while it runs."""
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    d = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20, answer_rounds=False),
                   PlanHooks(finish=Recording(lambda o, p: None)))  # fmt: skip
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    ids = [producer.submit(e) for e in (_fb(a, 1, [1]), _opt(a, 2), _fb(a, 3, [1]), _opt(a, 4))]
    d.run_once()
    assert [[r.seq_id for r in p.requests] for p in engine.plans] == [[1, 2, 3, 4]]
    assert all(results.has_many(ids))


@pytest.mark.parametrize("early", [True, False], ids=["early", "waits"])
def test_a_plan_filling_whole_microbatches_runs_them_without_waiting_for_the_tenants_still_expected(
    redis_client: redis.Redis, early: bool
) -> None:
    """Microbatches of 8 tokens; a, b, c and d were just answered, so all four are expected back. a and b return with
    4 tokens each: one full microbatch, which runs at once while c and d are on their way (with the setting off it
    waits for them, up to the window). Then c, a and b bring 12 tokens while d is still expected: the plan runs the 8
    that fill a microbatch, and the rest waits for d."""
    pool, (a, b, c, d) = _uid(), (f"{x}-{_uid()}" for x in "abcd")
    settings = Settings(plan_tokens=4096, microbatch_tokens=8, coalesce_early_full_microbatches=early)
    engine = ArithmeticEngine(dict.fromkeys((a, b, c, d), 1.0))
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    loop = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20, coalesce_s=2.0),
                      PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    _drain(loop, results, [producer.submit(_fb(m, 1, [1])) for m in (a, b, c, d)])
    second = [producer.submit(_fb(m, 2, [1, 1, 1, 1])) for m in (a, b)]
    started = time.monotonic()
    loop.run_once()
    waited = time.monotonic() - started
    assert all(results.has_many(second))
    assert waited < 1.0 if early else waited >= 1.5  # c and d never came back: the window (from their answer) ran out

    if not early:
        assert plan_stats.read(redis_client, pool).lapsed == 2  # the statistics name them: c and d
        return
    third = [producer.submit(_fb(c, 2, [1, 1, 1, 1])), producer.submit(_fb(a, 3, [1, 1, 1, 1])),
             producer.submit(_fb(b, 3, [1, 1, 1, 1]))]  # fmt: skip
    started = time.monotonic()
    loop.run_once()
    assert time.monotonic() - started < 1.0
    ran = [r for s in engine.plans[-1].steps for r in s.requests]
    assert sum(r.num_tokens for r in ran) == 8 and len(loop.pending) == 1  # one full microbatch now, the rest waits
    _drain(loop, results, third)


def test_the_coalescing_wait_checks_its_arrivals_for_stored_results_once_and_applies_each_once(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """Four adapters were just answered, so the loop waits for them; their next requests arrive one by one during the
    wait, one of them a request answered before (its entry read again, as after a crash before its ack). The plan
    takes the new ones, the answered one is acked without running again, and the arrivals' stored-result checks are
    made together, not one Redis round trip per arrival."""
    pool, models = _uid(), [f"m{i}-{_uid()}" for i in range(4)]
    engine = ArithmeticEngine(dict.fromkeys(models, 1.0))
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    loop = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20, coalesce_s=2.0),
                      PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    first = [_fb(m, 1, [1]) for m in models]
    _drain(loop, results, [producer.submit(env) for env in first])
    checks: list[int] = []
    has_many = loop.results.has_many

    def counted(request_ids: list[str]) -> list[bool]:
        checks.append(len(request_ids))
        return has_many(request_ids)

    loop.results.has_many = counted  # type: ignore[method-assign]
    stream = keys.request_stream(pool, first[0].tenant_id)
    again: list[bytes] = []
    producer.submit(_fb(models[0], 2, [2]))  # the first arrival: the round starts, and waits for the other three

    def arrive() -> None:
        for m in models[1:]:
            time.sleep(0.05)
            producer.submit(_fb(m, 2, [2]))
            if not again:  # the answered request's entry, delivered again during the wait
                again.append(redis_client.xadd(stream, encode(first[0])))

    sender = threading.Thread(target=arrive)
    sender.start()
    answered = loop.run_once()
    sender.join()
    # Every entry checked once: the first read's, then the wait's arrivals together, except that the re-read entry
    # (no next request of its adapter) makes the plan worth making at once, so its read is checked when it arrives.
    assert answered == 4 and sum(checks) == 5 and len(checks) <= 3, checks
    assert sorted((m, s) for m, s, _ in engine.applied) == sorted([(m, 1) for m in models] + [(m, 2) for m in models])
    assert not redis_client.xrange(stream, again[0], again[0])  # acked and gone, not run again


def test_an_optim_step_queued_before_its_forward_backward_waits_for_it_in_the_same_plan(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """Clients that send a step's two calls concurrently (the Python client does) may have them queued optim_step
    first. The round waits for the missing forward_backward (a plan without it would leave that adapter's step to a
    plan of its own) and runs both adapters' pairs in one plan, in seq order."""
    pool, (a, b) = _uid(), (f"a-{_uid()}", f"b-{_uid()}")
    engine = ArithmeticEngine({a: 1.0, b: 1.0})
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    loop = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20, coalesce_s=2.0),
                      PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    _drain(loop, results, [producer.submit(env) for m in (a, b) for env in (_fb(m, 1, [1]), _opt(m, 2))])
    producer.submit(_opt(a, 4))  # a's optim_step overtook its forward_backward
    producer.submit(_fb(b, 3, [2]))
    producer.submit(_opt(b, 4))
    late = threading.Timer(0.1, lambda: producer.submit(_fb(a, 3, [2])))
    late.start()
    started = time.monotonic()
    answered = loop.run_once()
    late.join()
    assert answered == 4 and time.monotonic() - started < 1.5  # one plan, without waiting out the 2 s window
    assert [(m, s) for m, s, _ in engine.applied if s > 2 and m == a] == [(a, 3), (a, 4)]


def test_a_tenant_is_waited_for_a_window_from_when_its_result_became_visible(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """The pool records a plan in SQL before it stores the results (here the finish step takes 0.6 s), and the
    tenants' round trips start when their results are visible: b, back 0.6 s after its result was stored (1.2 s after
    the plan was answered: past a 1 s window counted from the answer), still shares a's next plan."""
    pool, (a, b) = _uid(), (f"a-{_uid()}", f"b-{_uid()}")
    engine = ArithmeticEngine({a: 1.0, b: 1.0})
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)

    class SlowRecord(FinishStep):
        def __call__(self, answer: AnsweredPlan) -> None:
            time.sleep(0.6)
            super().__call__(answer)

    d = Dispatcher(redis_client, pool, engine,
                   DispatchConfig.from_settings(settings, block_ms=20, pipelined=True, coalesce_s=1.0),
                   PlanHooks(finish=SlowRecord(), applied_seq_lookup=lambda m: 0))  # fmt: skip
    first = [producer.submit(_fb(m, 1, [1])) for m in (a, b)]
    stop = threading.Event()
    loop = threading.Thread(target=d.run_forever, args=(stop,))
    loop.start()
    try:
        assert results.wait(first[0], 10) is not None
        second = [producer.submit(_fb(a, 2, [2]))]
        assert results.wait(first[1], 10) is not None
        time.sleep(0.6)
        second.append(producer.submit(_fb(b, 2, [2])))
        assert all(results.wait(r, 10) is not None for r in second)
    finally:
        stop.set()
        loop.join(timeout=10)
    (plan,) = [p for p in engine.plans if any(r.model_id == a and r.seq_id == 2 for r in p.requests)]
    assert sorted((r.model_id, r.seq_id) for r in plan.requests) == sorted([(a, 2), (b, 2)])


def test_a_plan_s_read_counts_the_rounds_that_held_only_an_optim_step_waiting_for_its_forward_backward(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """An optim_step read 0.3 s before its forward_backward: the rounds between plan nothing, and their wait is the
    next plan's read in the pool's statistics (else a closed loop whose client sends the two together shows the
    pool waiting ~0 ms for requests while it waited for one)."""
    pool, a = _uid(), f"a-{_uid()}"
    engine = ArithmeticEngine({a: 1.0})
    producer = Producer(redis_client, pool)
    loop = Dispatcher(redis_client, pool, engine, DispatchConfig.from_settings(settings, block_ms=20, coalesce_s=0.0),
                      PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    producer.submit(_opt(a, 2))
    late = threading.Timer(0.3, lambda: producer.submit(_fb(a, 1, [1])))
    late.start()
    deadline = time.monotonic() + 10
    while not engine.plans:
        assert time.monotonic() < deadline
        loop.run_once()
    late.join()
    assert [s for _, s, _ in engine.applied] == [1, 2]
    assert plan_stats.read(redis_client, pool).read_s >= 0.25


def test_a_request_read_while_the_loop_waits_is_traced_from_its_arrival(
    redis_client: redis.Redis, settings: Settings
) -> None:
    """Its trace's `read` is when the loop read it, not when the loop began to wait: the request arrives 0.3 s into a
    1 s wait, and neither its read time nor its enqueued time in the trace go back before its arrival."""
    pool, a = _uid(), f"a-{_uid()}"
    d = Dispatcher(redis_client, pool, ArithmeticEngine({a: 1.0}), DispatchConfig.from_settings(settings, block_ms=1000),
                   PlanHooks(applied_seq_lookup=lambda m: 0))  # fmt: skip
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    d.run_once()  # the stream and the consumer group exist; the loop's next read waits
    sent_at: list[float] = []
    request_ids: list[str] = []

    def send_late() -> None:
        time.sleep(0.3)
        sent_at.append(time.time())
        request_ids.append(producer.submit(_fb(a, 1, [1, 2])))

    sender = threading.Thread(target=send_late)
    sender.start()
    while not request_ids or not results.has_many(request_ids)[0]:
        d.run_once()
    sender.join()
    (record,) = request_traces.read(redis_client, [a])
    assert record.read >= sent_at[0] and record.enqueued >= sent_at[0] - 0.002  # the entry id: whole milliseconds
