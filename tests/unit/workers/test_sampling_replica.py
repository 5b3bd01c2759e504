"""The sampling replica (workers/sampling/replica.py) on one process: a whole copy of the base model loaded again,
checked against the training model's weights, wearing slot-bank layers that share the training banks. Sampling on it
gives what sampling on the engine itself gives (the reference), for trained adapters, mixed with base rows, on the
fused and the unfused LoRA paths; a replica that would not fit, or weights that differ, are refused with typed errors;
the rows split across ranks (workers/ranks/sampling.assign_rows) cover every sample once in contiguous balanced
ranges, and a job run in pieces (SampleJob.first_sample) samples what the whole job samples."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex.errors import CapacityError, EngineError
from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import lora_delta_reference
from loraplex.workers.ranks.sampling import Piece, assign_rows, piece_job, row_work
from loraplex.workers.sampling.jobs import SampleJob, SampleParams
from loraplex.workers.sampling.replica import ReplicaEngine, build_replica, replica_bytes
from loraplex.workers.sampling.sampler import Sampler


class _Loader:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, device: torch.device) -> torch.nn.Module:
        return load_base_model(str(self.folder), self.folder.parent, torch.float32, device)[0]


def _engine(tiny_dir: Path, fused: bool) -> Engine:
    """Two adapters (ranks 4 and 8) with random B on the model of `tiny_dir` (dense or MoE)."""
    model = _Loader(tiny_dir)(torch.device("cpu"))
    config = EngineConfig(num_slots=3, max_rank=8, lora_op=None if fused else lora_delta_reference)
    engine = build_engine(model, config)
    g = torch.Generator().manual_seed(5)
    for i, m in enumerate(("a", "b")):
        engine.create_adapter(m, 4 + 4 * i, 8.0, seed=i)
        w = engine.adapter_weights(m)
        engine.load_adapter_weights(m, {n: (a, 0.3 * torch.randn(b.shape, generator=g)) for n, (a, b) in w.items()})
    return engine


def _jobs(seed: int) -> list[SampleJob]:
    rng = random.Random(seed)
    jobs = []
    for model_id in ("a", "b", None, "a", "b"):
        params = SampleParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.9]), seed=rng.randint(0, 99),
                              stop_at_eos=False)  # fmt: skip
        prompt = tuple(rng.randint(2, 500) for _ in range(rng.randint(1, 8)))
        jobs.append(SampleJob(prompt, model_id, params, num_samples=rng.randint(1, 3), prompt_logprobs=True))
    return jobs


@pytest.mark.parametrize("fused", [True, False])
def test_sampling_on_the_replica_equals_sampling_on_the_engine(tiny_dir: Path, fused: bool) -> None:
    engine = _engine(tiny_dir, fused)
    replica = build_replica(engine, _Loader(tiny_dir))
    assert isinstance(replica, ReplicaEngine) and replica.training is engine
    assert replica.model is not engine.model and replica.adapter("a") == engine.adapter("a")
    q_train = engine.model.get_submodule("model.layers.0.self_attn.q_proj")
    q_replica = replica.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q_replica.lora_A is q_train.lora_A and q_replica.base is not q_train.base  # type: ignore[union-attr]
    for trial in range(2):
        jobs = _jobs(trial)
        want = Sampler(engine, max_rows=4).generate(jobs)
        got = Sampler(replica, max_rows=4).generate(jobs)
        for w, g in zip(want, got, strict=True):
            assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
            assert [s.logprobs for s in g.sequences] == [s.logprobs for s in w.sequences]
            assert g.prompt_logprobs == w.prompt_logprobs


def test_an_moe_replica_samples_what_the_moe_engine_samples(tiny_moe_dir: Path) -> None:
    """Expert LoRA too: the replica's experts modules read the training engine's expert banks."""
    engine = _engine(tiny_moe_dir, fused=True)
    assert any("experts" in name for name in engine.banks)
    replica = build_replica(engine, _Loader(tiny_moe_dir))
    jobs = _jobs(0)
    want = Sampler(engine, max_rows=4).generate(jobs)
    got = Sampler(replica, max_rows=4).generate(jobs)
    for w, g in zip(want, got, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.logprobs for s in g.sequences] == [s.logprobs for s in w.sequences]


def test_the_replica_reads_adapters_as_they_are_now(tiny_dir: Path) -> None:
    """Adapters created after the replica was built, and weights changed since, are what it samples."""
    engine = _engine(tiny_dir, fused=True)
    replica = build_replica(engine, _Loader(tiny_dir))
    engine.create_adapter("c", 8, 16.0, seed=9)
    w = engine.adapter_weights("c")
    engine.load_adapter_weights("c", {n: (a, torch.full_like(b, 0.05)) for n, (a, b) in w.items()})
    job = SampleJob((5, 6, 7), "c", SampleParams(max_tokens=8, temperature=0.0, stop_at_eos=False))
    base = SampleJob((5, 6, 7), None, SampleParams(max_tokens=8, temperature=0.0, stop_at_eos=False))
    want, got = Sampler(engine).generate([job, base]), Sampler(replica).generate([job, base])
    assert [o.sequences[0].tokens for o in got] == [o.sequences[0].tokens for o in want]
    assert got[0].sequences[0].logprobs != got[1].sequences[0].logprobs  # the adapter changes the output


def test_a_replica_that_does_not_fit_or_differs_is_refused(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, fused=True)
    assert replica_bytes(engine) == sum(
        p.numel() * 4 for n, p in engine.model.named_parameters() if "lora_" not in n
    )
    with pytest.raises(CapacityError, match="LORAPLEX_SAMPLER_REPLICA_FRACTION"):
        build_replica(engine, _Loader(tiny_dir), max_fraction=1e-9)

    def other_weights(device: torch.device) -> torch.nn.Module:
        model = _Loader(tiny_dir)(device)
        with torch.no_grad():
            model.get_submodule("model.layers.1.mlp.down_proj").weight.add_(1e-3)
        return model

    with pytest.raises(EngineError, match="down_proj"):
        build_replica(engine, other_weights)


def test_rows_split_across_ranks_cover_every_sample_once_in_balanced_contiguous_ranges() -> None:
    rng = random.Random(0)
    for _ in range(200):
        jobs = [
            SampleJob((1,) * rng.randint(1, 40), None, SampleParams(max_tokens=rng.randint(0, 64)),
                      num_samples=rng.randint(1, 16))  # fmt: skip
            for _ in range(rng.randint(0, 12))
        ]
        world = rng.randint(1, 4)
        shares = assign_rows(jobs, world)
        assert assign_rows(jobs, world) == shares  # the same on every rank
        rows = [(p.job, p.first + i) for share in shares for p in share for i in range(p.count)]
        assert rows == [(j, s) for j, job in enumerate(jobs) for s in range(job.num_samples)]  # in order, once each
        assert all(p.count >= 1 for share in shares for p in share)
        loads = [sum(p.count * row_work(jobs[p.job]) for p in share) for share in shares]
        if jobs:  # each range within one row of its fair share
            fair, row = sum(loads) / world, max(row_work(j) for j in jobs)
            assert all(abs(load - fair) <= row for load in loads), (loads, fair, row)
    one = SampleJob((1, 2, 3), None, SampleParams(max_tokens=5), num_samples=8)
    assert assign_rows([one], 2) == [[Piece(0, 0, 4)], [Piece(0, 4, 4)]]  # one job of many samples: both ranks


@pytest.mark.parametrize("fused", [True, False])
def test_a_job_run_in_pieces_samples_what_the_whole_job_samples(tiny_dir: Path, fused: bool) -> None:
    engine = _engine(tiny_dir, fused)
    sampler = Sampler(engine, max_rows=4)
    for model_id in ("a", None):
        job = SampleJob((7, 8, 9, 10), model_id, SampleParams(max_tokens=9, temperature=1.0, seed=3, stop_at_eos=False),
                        num_samples=7, prompt_logprobs=True, topk_sample_logprobs=2)  # fmt: skip
        (whole,) = sampler.generate([job])
        pieces = [Piece(0, 0, 2), Piece(0, 2, 4), Piece(0, 6, 1)]
        parts = sampler.generate([piece_job(job, p) for p in pieces])
        assert parts[0].prompt_logprobs == whole.prompt_logprobs and parts[1].prompt_logprobs is None
        merged = [s for out in parts for s in out.sequences]
        assert [s.tokens for s in merged] == [s.tokens for s in whole.sequences]
        for m, w in zip(merged, whole.sequences, strict=True):  # other rows beside it: fp32 rounding apart
            torch.testing.assert_close(torch.tensor(m.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        assert len({tuple(s.tokens) for s in merged}) > 1
