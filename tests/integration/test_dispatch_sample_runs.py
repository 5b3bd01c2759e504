"""Sample runs in flight as the dispatcher counts them, on a real redis-server: a run that ends in a plan where every
request finishes (nothing left unfinished, no request in parts) is in flight no more, so runs keep starting after
more than `sample_runs_in_flight` of them have ended, and an idle loop goes back to blocking reads. The engine is a
stand-in answering each sample after two plans (the real sampler: tests/unit/workers/test_sampler_slices.py)."""

from __future__ import annotations

import time

import redis

from loraplex.dispatch.hooks import DispatchConfig, PlanHooks
from loraplex.dispatch.loop import Dispatcher
from loraplex.protocol import BatchPlan, Outcome
from loraplex.protocol.results import SampledSequence, SampleResult
from loraplex.queue.envelope import Envelope
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings
from tests.helpers.finish import Recording

SAMPLED = SampleResult((SampledSequence([1, 2], [-0.1, -0.2], "length"),))


class TwoPlanSampler:
    """Each sample is unfinished in the first plan that names it and answered in the second."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        out = []
        for r in plan.requests:
            if r.request_id in self.seen:
                out.append(Outcome(r.request_id, result=SAMPLED))
            else:
                self.seen.add(r.request_id)
                out.append(Outcome(r.request_id, unfinished=True))
        return out


def test_ended_runs_leave_the_in_flight_count_and_new_ones_keep_starting(redis_client: redis.Redis) -> None:
    pool = f"runs-{time.monotonic_ns()}"
    config = DispatchConfig.from_settings(Settings(), block_ms=10, sample_runs_in_flight=2)
    d = Dispatcher(redis_client, pool, TwoPlanSampler(), config, PlanHooks(finish=Recording(lambda o, p: None)))
    producer, results = Producer(redis_client, pool), ResultStore(redis_client)
    try:
        for seq in range(6):  # one after another: each run ends in a plan of its own
            env = Envelope.new(tenant_id="t", model_id="sampler-1", seq_id=seq, kind="sample",
                               payload={"prompt": [3, 5], "num_samples": 1, "max_tokens": 2})  # fmt: skip
            producer.submit(env)
            deadline = time.monotonic() + 10
            while not results.has_many([env.request_id])[0]:
                assert time.monotonic() < deadline, f"sample {seq} never ran: in flight {d._sampling}"
                d.run_once()
            assert d._sampling == {}
    finally:
        d.close()
