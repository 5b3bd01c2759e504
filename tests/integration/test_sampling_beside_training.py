"""A training tenant beside a tenant sampling a long generation, through the real stack (embedded: redis-server child,
SQLite, gateway, one CPU pool process on the tiny model with the native sampler and its default slices): the
trainer's median closed-loop step is at most about one sampling slice above its median alone, and the sample,
interrupted by many training plans, completes equal to the same seeded sample run alone."""

from __future__ import annotations

import statistics
import time

import pytest

from loraplex.client import ServiceClient
from tests.security.harness import Victim, running_stack, tenant_key

SAMPLES, NEW_TOKENS = 16, 384
MARGIN_S = 0.150  # this 2-core machine runs the clients, the gateway and the pool together


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("beside")) as s:
        yield s


def test_a_trainer_beside_a_long_sample_waits_at_most_one_slice_and_the_sample_is_unchanged(stack) -> None:
    slice_s = stack.settings.sample_slice_ms / 1000
    trainer = Victim(stack, "trainer")
    sampling = ServiceClient(stack.base_url, tenant_key(stack, "sampler"))
    try:
        sampler = sampling.create_sampling_client(base_model=stack.settings.base_model)
        prompt = list(range(20, 36))

        def sample() -> dict:
            return sampler.sample(prompt, num_samples=SAMPLES, max_tokens=NEW_TOKENS, seed=11, stop=[]).result(timeout=300)

        sample()  # warm the sampler's path at these shapes
        started = time.perf_counter()
        quiet = sample()
        quiet_s = time.perf_counter() - started
        alone = trainer.alone(15)
        with trainer.training() as beside:
            started = time.perf_counter()
            busy = sample()
            busy_s = time.perf_counter() - started
            steps_while_sampling = len(beside)
        figures = {"alone_median_ms": 1e3 * statistics.median(alone), "beside_median_ms": 1e3 * statistics.median(beside),
                   "sample_alone_s": quiet_s, "sample_beside_s": busy_s, "steps_while_sampling": steps_while_sampling}  # fmt: skip
        print(figures)
        assert steps_while_sampling >= 5, figures  # the trainer kept stepping while the sample ran: slices interleaved
        assert statistics.median(beside) <= statistics.median(alone) + slice_s + MARGIN_S, figures
        assert [s["tokens"] for s in busy["sequences"]] == [s["tokens"] for s in quiet["sequences"]]
        for b, q in zip(busy["sequences"], quiet["sequences"], strict=True):
            assert b["logprobs"] == pytest.approx(q["logprobs"], abs=1e-5)
        assert all(len(s["tokens"]) == NEW_TOKENS for s in busy["sequences"])
    finally:
        sampling.close()
        trainer.close()
