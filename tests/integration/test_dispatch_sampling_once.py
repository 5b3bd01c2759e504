"""Each request runs once per request id, on a real redis-server: a plan (or a sample run held over
many plans) longer than the stale-entry claim's idle time is never claimed back and run again, by this dispatcher or
another consumer, and a redelivered twin of a sample being finished is answered by its result, not run again. The
engine is a stand-in that counts what it starts (the real sampler is tested in tests/unit/workers/test_sampler_slices.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import redis

from loraplex.dispatch.hooks import DispatchConfig, PlanHooks
from loraplex.dispatch.loop import Dispatcher
from loraplex.protocol import BatchPlan, Outcome, StepKind
from loraplex.protocol.results import ForwardBackwardResult, SampledSequence, SampleResult
from loraplex.queue import keys
from loraplex.queue.consumer import Consumer
from loraplex.queue.envelope import Envelope, encode
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings
from tests.helpers.finish import Recording

CLAIM_IDLE_MS = 100

SAMPLED = SampleResult((SampledSequence([1, 2, 3], [-0.1, -0.2, -0.3], "length"),))


class SlicedSampler:
    """Answers a sample after `slices` plans of `plan_s` seconds each (unfinished before); counts each start."""

    def __init__(self, slices: int, plan_s: float) -> None:
        self.slices, self.plan_s = slices, plan_s
        self.left: dict[str, int] = {}
        self.starts: list[str] = []

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        time.sleep(self.plan_s)
        outcomes = []
        for r in plan.requests:
            if r.request_id not in self.left:
                self.starts.append(r.request_id)
                self.left[r.request_id] = self.slices
            self.left[r.request_id] -= 1
            if self.left[r.request_id] > 0:
                outcomes.append(Outcome(r.request_id, unfinished=True))
            else:
                del self.left[r.request_id]
                outcomes.append(Outcome(r.request_id, result=SAMPLED))
        return outcomes


def _sample(session: str) -> Envelope:
    payload = {"prompt": [3, 5, 7], "num_samples": 2, "max_tokens": 3}
    return Envelope.new(tenant_id="t-s", model_id=session, seq_id=0, kind="sample", payload=payload)


def _dispatcher(redis_client: redis.Redis, pool: str, engine: SlicedSampler, on_outcomes: Any = None) -> Dispatcher:
    config = DispatchConfig.from_settings(Settings(), block_ms=10, claim_idle_ms=CLAIM_IDLE_MS, claim_every_s=0.0,
                                          pipelined=True)  # fmt: skip
    return Dispatcher(redis_client, pool, engine, config, PlanHooks(finish=Recording(on_outcomes or (lambda o, p: None))))


def _until_answered(d: Dispatcher, results: ResultStore, ids: list[str], also: float = 0.5) -> None:
    """Run the loop until the results are stored, and `also` seconds more (a second run would show then)."""
    deadline = time.monotonic() + 15
    while not all(results.has_many(ids)):
        assert time.monotonic() < deadline, "not answered"
        d.run_once()
    end = time.monotonic() + also
    while time.monotonic() < end:
        d.run_once()
    d.close()


def test_a_plan_longer_than_the_claim_idle_time_runs_once(redis_client: redis.Redis) -> None:
    """A plan far longer than the claim's idle time: a 0.3 s plan, a 0.1 s claim idle time, and a
    slow SQL record (0.4 s) keeping the answered entry unacked while the loop claims again."""
    pool, engine = uuid.uuid4().hex[:8], SlicedSampler(slices=1, plan_s=0.3)
    env = _sample("sess-1")
    Producer(redis_client, pool).submit(env)
    results = ResultStore(redis_client)
    d = _dispatcher(redis_client, pool, engine, on_outcomes=lambda outcomes, plan: time.sleep(0.4))
    _until_answered(d, results, [env.request_id])
    assert engine.starts == [env.request_id]
    assert redis_client.xlen(keys.request_stream(pool, "t-s")) == 0


def test_a_sample_held_over_many_plans_is_never_claimed_by_anyone(redis_client: redis.Redis) -> None:
    pool, engine = uuid.uuid4().hex[:8], SlicedSampler(slices=30, plan_s=0.02)  # ~0.6 s in flight
    env = _sample("sess-2")
    Producer(redis_client, pool).submit(env)
    results = ResultStore(redis_client)
    d = _dispatcher(redis_client, pool, engine)
    other = Consumer(redis_client, pool, "another-node")
    taken = []
    deadline = time.monotonic() + 15
    while not results.has_many([env.request_id])[0]:
        assert time.monotonic() < deadline, "not answered"
        d.run_once()
        taken += other.claim_stale(CLAIM_IDLE_MS)  # another consumer's stale-entry rule, all along
    _until_answered(d, results, [env.request_id])
    assert taken == [] and engine.starts == [env.request_id]
    assert results.get(env.request_id).result == SAMPLED


def test_a_redelivered_twin_of_a_sample_being_finished_runs_once(redis_client: redis.Redis) -> None:
    pool, engine = uuid.uuid4().hex[:8], SlicedSampler(slices=2, plan_s=0.01)
    env = _sample("sess-3")
    Producer(redis_client, pool).submit(env)
    stream = keys.request_stream(pool, "t-s")
    results = ResultStore(redis_client)

    def record(outcomes: list[Outcome], plan: BatchPlan) -> None:
        if any(o.request_id == env.request_id for o in outcomes):
            redis_client.xadd(stream, encode(env))  # the same request delivered again while its result is on its way
            time.sleep(0.3)

    d = _dispatcher(redis_client, pool, engine, on_outcomes=record)
    _until_answered(d, results, [env.request_id], also=1.0)
    assert engine.starts == [env.request_id]
    assert redis_client.xlen(stream) == 0  # the twin was answered and acked


class TrainingThenSampling:
    """Trains in `train_s`; a SAMPLE step notes the seconds it was given and whether the training's result was
    already stored when it began (it waits for it at most 2 s: the finisher writes it in the background)."""

    def __init__(self, results: ResultStore, train_s: float) -> None:
        self.results, self.train_s = results, train_s
        self.calls: list[tuple[str, ...]] = []
        self.sample_seconds: list[float | None] = []
        self.trained_first: list[bool] = []
        self.trained: list[str] = []

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        self.calls.append(tuple(str(s.kind) for s in plan.steps))
        outcomes = []
        for step in plan.steps:
            if step.kind == StepKind.SAMPLE:
                self.sample_seconds.append(step.seconds)
                deadline = time.monotonic() + 2
                while self.trained and not all(self.results.has_many(self.trained)) and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.trained_first.append(all(self.results.has_many(self.trained)))
                outcomes += [Outcome(r.request_id, result=SampleResult()) for r in step.requests]
            else:
                time.sleep(self.train_s)
                self.trained += [r.request_id for r in step.requests]
                outcomes += [Outcome(r.request_id, result=ForwardBackwardResult(metrics={"loss:sum": 0.0})) for r in step.requests]
        return outcomes


def test_a_plan_answers_its_training_before_its_sample_slice_which_gets_the_training_s_time(
    redis_client: redis.Redis,
) -> None:
    """A plan with training and a sample runs the training first, hands its results to the finisher, then the slice,
    for at most as long as the training took (Step.seconds): beside training, sampling takes half the pool."""
    pool = uuid.uuid4().hex[:8]
    results = ResultStore(redis_client)
    engine = TrainingThenSampling(results, train_s=0.05)
    data = [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1.0] * 3}}]
    fb = Envelope.new(tenant_id="t-a", model_id="a", seq_id=1, kind="forward_backward",
                      payload={"data": data, "loss_fn": "cross_entropy", "loss_fn_config": {}})  # fmt: skip
    sample = _sample("sess-4")
    for env in (fb, sample):
        Producer(redis_client, pool).submit(env)
    d = _dispatcher(redis_client, pool, engine)
    d.seed_applied({"a": 0})
    _until_answered(d, results, [fb.request_id, sample.request_id], also=0.0)
    assert ("forward_backward",) in engine.calls and ("sample",) in engine.calls
    assert not any(len(c) > 1 and "sample" in c for c in engine.calls)  # never a slice inside a training plan
    assert engine.trained_first == [True]
    assert engine.sample_seconds[0] is not None and 0.04 <= engine.sample_seconds[0] < 0.5
