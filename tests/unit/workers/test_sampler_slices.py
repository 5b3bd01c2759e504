"""The native sampler in slices: a run advanced a little at a time gives exactly the tokens of one
whole generate call, training and swaps between its slices change nothing it reads, and the SAMPLE step answers a
request only when its run ends, starting each request id once."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model, load_tokenizer
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import SampleResult
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.lora import lora_delta_reference
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.step import SampleStep
from loraplex.workers.state.adapter_store import AdapterStore

DATA = [{"model_input": [3, 5, 7, 9, 11, 13], "loss_fn_inputs": {"target_tokens": [5, 7, 9, 11, 13, 15]}}]


def _engine(tiny_dir: Path, fused: bool, slots: int) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(num_slots=slots, max_rank=8, lora_op=None if fused else lora_delta_reference))


def _random_jobs(rng: random.Random, adapters: list[str | None], n: int) -> list[SampleJob]:
    jobs = []
    for _ in range(n):
        params = SampleParams(
            max_tokens=rng.randint(0, 14), temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([-1, 5]),
            seed=rng.randint(0, 1000), stop_at_eos=False,
        )  # fmt: skip
        prompt = tuple(rng.randint(2, 500) for _ in range(rng.randint(1, 9)))
        jobs.append(SampleJob(prompt, rng.choice(adapters), params, num_samples=rng.randint(1, 5),
                              prompt_logprobs=rng.random() < 0.3, topk_sample_logprobs=rng.choice([0, 2])))  # fmt: skip
    return jobs


@pytest.mark.parametrize("fused", [True, False])
def test_a_run_in_slices_gives_the_tokens_of_one_whole_call(tiny_dir: Path, fused: bool) -> None:
    engine = _engine(tiny_dir, fused, slots=3)
    g = torch.Generator().manual_seed(3)
    for i, m in enumerate(("a", "b")):
        engine.create_adapter(m, 4, 8.0, seed=i)
        w = engine.adapter_weights(m)
        engine.load_adapter_weights(m, {n: (a, 0.4 * torch.randn(b.shape, generator=g)) for n, (a, b) in w.items()})
    sampler = Sampler(engine, max_rows=4)  # fewer rows than samples: rows join mid-run (continuous batching)
    for trial in range(3):
        jobs = _random_jobs(random.Random(trial), ["a", "b", None], 6)
        whole = sampler.generate(jobs)
        run = sampler.start(jobs)
        slices = 1
        while not run.advance(0.0):  # the smallest slice: one admission or decode step
            slices += 1
        assert slices > 5
        for w, s in zip(whole, run.outputs, strict=True):
            assert [q.tokens for q in w.sequences] == [q.tokens for q in s.sequences]
            assert [q.logprobs for q in w.sequences] == [q.logprobs for q in s.sequences]
            assert [q.topk_logprobs for q in w.sequences] == [q.topk_logprobs for q in s.sequences]
            assert w.prompt_logprobs == s.prompt_logprobs


def _sample(rid: str, copy_id: str, max_tokens: int = 10) -> PlannedRequest:
    payload = {"prompt": [3, 5, 7, 11], "sampler_copy": copy_id, "max_tokens": max_tokens, "temperature": 1.0,
               "seed": 5, "num_samples": 2, "stop_token_ids": [], "stop_at_eos": False}  # fmt: skip
    return PlannedRequest(rid, "t", "sampler-1", 0, RequestKind.SAMPLE, payload)


def _train(executor: PlanExecutor, model_id: str, seq: int) -> None:
    fb = PlannedRequest(f"fb-{model_id}-{seq}", "t", model_id, seq, RequestKind.FORWARD_BACKWARD, {"data": DATA})
    opt = PlannedRequest(f"o-{model_id}-{seq}", "t", model_id, seq + 1, RequestKind.OPTIM_STEP,
                         {"adam_params": {"learning_rate": 0.5}})  # fmt: skip
    plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb,)), Step(StepKind.OPTIM_STEP, (opt,))))
    assert all(o.ok for o in executor.execute(plan))


@pytest.mark.parametrize("fused", [True, False])
def test_training_and_swaps_between_slices_change_nothing_an_in_flight_sample_reads(
    tiny_dir: Path, tmp_path: Path, fused: bool
) -> None:
    """Two slots and three adapters: between slices the sampler copy's own source trains (lr 0.5) and the other
    adapters swap through the slots, so the copy leaves its slot and comes back elsewhere; the sliced result still
    equals an unsliced run of the same request on an untouched pool."""
    results = []
    for sliced in (False, True):
        engine = _engine(tiny_dir, fused, slots=2)
        store = AdapterStore(engine, 1 << 30, tmp_path / f"spill-{sliced}")
        sampler = Sampler(engine, load_tokenizer(str(tiny_dir), tiny_dir.parent), max_rows=2)
        step = SampleStep(sampler, store, slice_s=0.0 if sliced else None)
        executor = PlanExecutor(engine, store, step)
        for i, m in enumerate(("a", "b", "c")):
            store.create(m, 4, 8.0, seed=i)
        _train(executor, "a", 1)
        path = "tinker://a/sampler_weights/w1"
        save = PlannedRequest("s-w1", "t", "a", 3, RequestKind.SAVE_SAMPLER,
                              {"name": "w1", "path": path, "directory": str(tmp_path / f"w1-{sliced}")})  # fmt: skip
        assert executor.execute(BatchPlan((Step(StepKind.CHECKPOINT, (save,)),)))[0].ok
        # two requests, two rows: the second one's prompt is prefilled after the first is done, past many swaps
        requests = (_sample("x", path), _sample("y", path))
        outcomes, seq, slots_seen = [], 10, set()
        while True:
            out, later = executor.execute(BatchPlan((Step(StepKind.SAMPLE, requests),)))
            outcomes.append(out)
            if not later.unfinished:
                break
            if engine.is_resident(path):
                slots_seen.add(engine.adapter(path).slot)
            for m in ("a", "b", "c"):  # training, and every adapter through the two slots
                _train(executor, m, seq)
            seq += 2
            for m in (path, "a", "b", "c"):  # all out, then b and c in: the copy comes back to another slot
                store.evict(m)
            store.ensure_resident(["b"])  # the first free slot: where the copy started
            store.ensure_resident(["c"])
            store.touch("b")  # c is the least recently used: the copy comes back in c's slot
        assert outcomes[-1].ok, outcomes[-1].error
        assert all(o.ok and o.result is None for o in outcomes[:-1])
        assert (len(outcomes) > 3) == sliced
        if sliced and not fused:  # the unfused path swaps the copy back in for each slice, in another slot
            assert len(slots_seen) > 1
        assert step.executions == 2 and step.in_flight == set()
        results.append(later.result)
    assert results[0] == results[1]
    assert [len(s.tokens) for s in results[1].expect(SampleResult).sequences] == [10] * 2


def test_a_request_id_in_flight_is_not_started_again(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_dir, True, slots=2)
    store = AdapterStore(engine, 1 << 30, tmp_path / "spill")
    sampler = Sampler(engine, max_rows=2)
    step = SampleStep(sampler, store, slice_s=0.0)
    base = {"prompt": [3, 5], "max_tokens": 16, "num_samples": 3, "seed": 1, "stop_at_eos": False}
    first = PlannedRequest("same-id", "t", "sess", 0, RequestKind.SAMPLE, base)
    twin = PlannedRequest("same-id", "t", "sess", 0, RequestKind.SAMPLE, base)  # a redelivered entry of it
    outs = step(Step(StepKind.SAMPLE, (first,)))
    while outs[0].unfinished:
        outs = step(Step(StepKind.SAMPLE, (twin,)))
    assert outs[0].ok and [len(s.tokens) for s in outs[0].result.expect(SampleResult).sequences] == [16] * 3
    assert step.executions == 1


def test_a_slice_beside_training_runs_its_seconds_and_an_idle_one_yields_to_arrivals(tiny_dir: Path, tmp_path: Path) -> None:
    """Step.seconds caps the slice below `slice_s` (and `yield_now` does not cut it); a slice with no seconds (an
    otherwise idle pool) stops after one round once `yield_now()` is true."""
    engine = _engine(tiny_dir, True, slots=2)
    sampler = Sampler(engine, max_rows=2)
    asked: list[int] = []
    step = SampleStep(sampler, AdapterStore(engine, 1 << 30, tmp_path / "spill"), slice_s=60.0,
                      yield_now=lambda: asked.append(1) is None)  # always: requests wait  # fmt: skip
    payload = {"prompt": [3, 5], "max_tokens": 40, "num_samples": 2, "seed": 1, "stop_at_eos": False}
    request = PlannedRequest("r", "t", "sess", 0, RequestKind.SAMPLE, payload)
    started = time.perf_counter()
    assert step(Step(StepKind.SAMPLE, (request,), seconds=0.0))[0].unfinished  # one round: admission, no more
    assert asked == [] and time.perf_counter() - started < 5
    before = sampler.stats.decode_steps
    assert step(Step(StepKind.SAMPLE, (request,)))[0].unfinished  # idle pool, but requests wait: one decode step
    assert asked == [1] and sampler.stats.decode_steps == before + 1
    step.yield_now = None
    out = step(Step(StepKind.SAMPLE, (request,)))[0]  # nobody waits: to the end within the 60 s slice
    assert out.ok and [len(s.tokens) for s in out.result.expect(SampleResult).sequences] == [40, 40]
