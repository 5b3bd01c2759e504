"""The SAMPLE step on the pool (workers/sampling/step.py through the PlanExecutor): it samples the sampler copy a
named sampler save took, not the adapter that trained on; a pool without the copy loads it from the checkpoint
folder; a request that cannot run fails alone; more copies than slots run in groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.models import load_base_model, load_tokenizer
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import SampleResult
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.step import SampleStep
from loraplex.workers.state.adapter_store import AdapterStore

DATA = [{"model_input": [3, 5, 7, 9, 11, 13], "loss_fn_inputs": {"target_tokens": [5, 7, 9, 11, 13, 15]}}]
PROMPT = [3, 5, 7]


@pytest.fixture
def pool(tiny_dir: Path, tmp_path: Path):
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=4))
    store = AdapterStore(engine, 1 << 30, tmp_path / "spill")
    sampler = Sampler(engine, load_tokenizer(str(tiny_dir), tiny_dir.parent))
    return PlanExecutor(engine, store, SampleStep(sampler, store)), store, sampler


def _run(executor: PlanExecutor, kind: StepKind, *requests: PlannedRequest):
    return executor.execute(BatchPlan((Step(kind, tuple(requests)),)))


def _train(executor: PlanExecutor, model_id: str, seq: int) -> None:
    fb = PlannedRequest(f"fb-{model_id}-{seq}", "t", model_id, seq, RequestKind.FORWARD_BACKWARD, {"data": DATA})
    opt = PlannedRequest(f"o-{model_id}-{seq}", "t", model_id, seq + 1, RequestKind.OPTIM_STEP,
                         {"adam_params": {"learning_rate": 0.2}})  # fmt: skip
    assert all(o.ok for o in executor.execute(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb,)),
                                                           Step(StepKind.OPTIM_STEP, (opt,))))))  # fmt: skip


def _save(executor: PlanExecutor, model_id: str, name: str, folder: Path) -> str:
    path = f"tinker://{model_id}/sampler_weights/{name}"
    save = PlannedRequest(f"s-{name}", "t", model_id, 9, RequestKind.SAVE_SAMPLER,
                          {"name": name, "path": path, "directory": str(folder / name)})  # fmt: skip
    (out,) = _run(executor, StepKind.CHECKPOINT, save)
    assert out.ok, out.error
    return path


def _sample(rid: str, copy_id: str | None, directory: str | None = None, **params) -> PlannedRequest:
    payload = {"prompt": PROMPT, "sampler_copy": copy_id, "sampler_copy_dir": directory, "max_tokens": 6,
               "temperature": 0.0, "prompt_logprobs": True, **params}  # fmt: skip
    return PlannedRequest(rid, "t", "sampler-1", 0, RequestKind.SAMPLE, payload)


def test_a_sample_reads_the_sampler_copy_not_the_adapter_that_trained_on(pool, tmp_path) -> None:
    executor, store, sampler = pool
    store.create("a", 4, 8.0, seed=1)
    for seq in (1, 3):
        _train(executor, "a", seq)
    store.ensure_resident(["a"])
    at_save = sampler.generate([SampleJob(tuple(PROMPT), "a", SampleParams(max_tokens=6, temperature=0.0))])[0]
    path = _save(executor, "a", "w1", tmp_path)
    for seq in (10, 12, 14):
        _train(executor, "a", seq)  # the adapter moves on
    (from_copy, from_base) = _run(executor, StepKind.SAMPLE, _sample("x", path), _sample("y", None))
    assert from_copy.ok and from_base.ok, (from_copy.error, from_base.error)
    sampled = _samples(from_copy)
    seq = sampled.sequences[0]
    assert seq.tokens == at_save.sequences[0].tokens
    assert seq.logprobs == pytest.approx(at_save.sequences[0].logprobs, abs=1e-5)
    assert sampled.prompt_logprobs is not None and sampled.prompt_logprobs[0] is None
    assert len(sampled.prompt_logprobs) == 3

    # A pool that does not hold the copy (a restart) loads it from the checkpoint's folder.
    store.delete(path)
    (reloaded,) = _run(executor, StepKind.SAMPLE, _sample("z", path, str(tmp_path / "w1")))
    assert reloaded.ok and _samples(reloaded).sequences[0].tokens == at_save.sequences[0].tokens


def test_a_request_that_cannot_run_fails_alone_and_copies_beyond_the_slots_run_in_groups(pool, tmp_path) -> None:
    executor, store, _ = pool
    paths = []
    for i, name in enumerate(("a", "b", "c")):
        store.create(name, 2, 4.0, seed=i)
        _train(executor, name, 1)
        paths.append(_save(executor, name, f"w-{name}", tmp_path))
    requests = [_sample(f"r{i}", p, num_samples=2) for i, p in enumerate(paths)]  # 3 sampler copies, 2 slots
    requests.append(_sample("missing", "tinker://nobody/sampler_weights/x"))
    requests.append(_sample("bad", paths[0], prompt=[10**6]))
    outcomes = _run(executor, StepKind.SAMPLE, *requests)
    assert [o.ok for o in outcomes] == [True, True, True, False, False]
    assert outcomes[3].error_name == "NotFoundError" and outcomes[4].error_name == "InvalidRequestError"
    assert all(len(_samples(o).sequences) == 2 for o in outcomes[:3])


def _samples(outcome) -> SampleResult:
    assert outcome.result is not None
    return outcome.result.expect(SampleResult)
