"""What the sampler tests share: an engine from a local folder with adapters whose B is far from zero (so each adapter
changes the model's tokens) and the tiny model's five adapters (`ADAPTERS`; the `tiny_sampler_engine` fixture of
tests/unit/conftest.py builds them), prompts, the comparison of two sampled
sequences and transformers + PEFT greedy generation (tests/unit/workers/test_sampler*.py and the GPU sampler tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.sampling.jobs import SampledSequence, SampleJob, SampleOutput, SampleParams
from loraplex.workers.sampling.sampler import Sampler

# model_id -> (rank, alpha, seed) or (rank, alpha, seed, target modules or None for the pool's)
AdapterSpecs = Mapping[str, tuple[Any, ...]]


def engine_with_adapters(
    model_dir: Path,
    adapters: AdapterSpecs,
    num_slots: int,
    max_rank: int,
    seed: int,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> tuple[Engine, Any]:
    """The engine (its model on `device`) and the folder's tokenizer, each adapter created with its spec and given a
    random B of scale 0.4 (drawn in adapter order from a generator seeded with `seed`)."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    model, tokenizer = load_base_model(str(model_dir), model_dir.parent, **kwargs)
    engine = build_engine(model.to(device), EngineConfig(num_slots=num_slots, max_rank=max_rank))
    g = torch.Generator().manual_seed(seed)
    for model_id, spec in adapters.items():
        rank, alpha, adapter_seed, *rest = spec
        targets: Sequence[str] | None = rest[0] if rest else None
        engine.create_adapter(model_id, rank, alpha, adapter_seed, targets)
        weights = engine.adapter_weights(model_id)
        engine.load_adapter_weights(
            model_id, {n: (a, 0.4 * torch.randn(b.shape, generator=g)) for n, (a, b) in weights.items()}
        )
    return engine, tokenizer


# model_id: (rank, alpha, seed, target_modules); different ranks share the rank-16 banks by zero padding.
ADAPTERS: dict[str, tuple[int, float, int, tuple[str, ...] | None]] = {
    "r2": (2, 4.0, 11, None),
    "r4": (4, 4.0, 12, None),
    "r8": (8, 16.0, 13, None),
    "r16": (16, 16.0, 14, None),
    "attn": (4, 8.0, 15, ("q_proj", "v_proj")),  # a subset of the pool's modules
}
GREEDY = SampleParams(max_tokens=12, temperature=0.0)


def prompt(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(2, 512, (n,), generator=g).tolist())


def alone(sampler: Sampler, job: SampleJob) -> SampleOutput:
    return sampler.generate([job])[0]


def assert_same(a: SampledSequence, b: SampledSequence, tol: float = 1e-5) -> None:
    assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) <= tol


def hf_greedy(
    model: torch.nn.Module, ids: tuple[int, ...], max_new: int, tokenizer: Any
) -> tuple[list[int], list[float]]:
    out: Any = model.generate(  # type: ignore[operator]
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=False)]
    return tokens, logprobs


def assert_mixed_equals_each_alone(sampler: Sampler, jobs: Sequence[SampleJob]) -> list[SampleOutput]:
    """One generate of these jobs (one greedy sample each) runs them as one batch with one prefill, and each row gets
    what its job gets alone; returns the batch's outputs."""
    mixed = sampler.generate(jobs)
    assert sampler.stats.peak_rows == len(jobs) and sampler.stats.prefill_forwards == 1  # one batch, one prefill
    for job, out in zip(jobs, mixed, strict=True):
        assert_same(out.sequences[0], alone(sampler, job).sequences[0])
    return mixed
