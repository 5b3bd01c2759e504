"""A training step's host-to-device copies on CUDA: every one comes from pinned memory. A copy from pageable memory
waits for the GPU's queue to drain, so the host stops running ahead of the device: a copy made after the forward is
queued holds the host until the forward has run, and the device then idles while the host queues the rest. Checked
with a dispatch mode that sees every copy a forward_backward makes, on the eager path (two microbatches, so the
second microbatch's inputs are copied while the first one runs) and on replayed CUDA graphs, with a loss that reads
extra inputs (importance_sampling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from tests.helpers.datums import with_datums
from tests.helpers.gpu import add_four_adapters, random_data

pytestmark = pytest.mark.gpu


class PageableCopies(TorchDispatchMode):
    """Records every host-to-CUDA copy whose source is not pinned (its op and shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            src, device = args[0], kwargs.get("device")
            if _pageable(src) and device is not None and torch.device(device).type == "cuda":
                self.seen.append(f"_to_copy {tuple(src.shape)}")
        elif func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.is_cuda and _pageable(src):
                self.seen.append(f"copy_ {tuple(src.shape)}")
        return func(*args, **kwargs)


def _pageable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 1 and not t.is_pinned()


def _items(g: torch.Generator) -> list[tuple]:
    data = random_data(g, 3, 48)
    for d in data:  # importance_sampling reads the sampler's logprobs and the advantages: two more copies a run
        n = len(d["model_input"])
        d["loss_fn_inputs"] = {"target_tokens": d["loss_fn_inputs"]["target_tokens"], "logprobs": [-1.0] * n,
                               "advantages": [0.5] * n}  # fmt: skip
    return [("a", data, "importance_sampling"), ("b", random_data(g, 2, 40), "cross_entropy")]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_training_step_copies_nothing_from_pageable_memory(
    tmp_path_factory: pytest.TempPathFactory, graphs: bool
) -> None:
    from loraplex.models import load_base_model, resolve

    tiny_dir: Path = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=torch.bfloat16, device="cuda")
    # 200 tokens a microbatch: the items' 224 tokens run as two microbatches
    engine = build_engine(model, EngineConfig(num_slots=6, max_rank=16, microbatch_tokens=200, cuda_graphs=graphs))
    add_four_adapters(engine)
    g = torch.Generator().manual_seed(5)
    items = _items(g)
    for _ in range(3):  # graph buckets captured on their second sighting, replayed from the third
        engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
    prepared = [engine.prepare(*with_datums(it)) for it in items]
    with PageableCopies() as copies:
        results = engine.forward_backward(prepared)
    assert copies.seen == [], copies.seen
    assert all(len(r["loss_fn_outputs"]) > 0 for r in results)
    if graphs:
        assert engine.graphs is not None and engine.graphs.replays > 0
