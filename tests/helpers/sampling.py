"""The sampler tests' engine: a base model from a local folder with adapters whose B is far from zero (so each
adapter changes the model's tokens), shared by tests/unit/workers/test_sampler*.py and the GPU sampler tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine

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
