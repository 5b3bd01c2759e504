"""Engine.rows_to_host_async on CUDA (the durable snapshots' copy): the rows as they were when it was called, though
training went on before the copy ran, with the copy made from another thread (the snapshot writer's) through the
engine's pinned staging buffers; weights_to_host_async the same; and PinnedStaging against `.cpu()`, the plain copy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.pinned_staging import PinnedStaging
from loraplex.workers.state.slot_rows import SLOT_ROWS
from tests.helpers.datums import datums

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ADAM = {"learning_rate": 1e-2}


def _train(engine: Engine, k: int) -> None:
    toks = [(k * 7 + j * 3) % 300 + 1 for j in range(65)]
    datum = {"model_input": toks[:-1], "loss_fn_inputs": {"target_tokens": toks[1:], "weights": [1.0] * 64}}
    engine.forward_backward([engine.prepare("a", datums([datum]), "cross_entropy", None, False)])
    engine.optim_step([("a", ADAM)])


def test_the_copy_holds_the_rows_as_they_were_when_taken(tiny_dir: Path) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=torch.bfloat16, device="cuda")
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=8), "cuda")
    slot = engine.create_adapter("a", 8, 16.0, seed=1).slot
    _train(engine, 0)
    engine.forward_backward([engine.prepare("a", datums([{"model_input": [1, 2, 3], "loss_fn_inputs": {
        "target_tokens": [2, 3, 4], "weights": [1.0] * 3}}]), "cross_entropy", None, False)])  # fmt: skip
    want = engine.read_slot(slot)  # unconsumed gradients in it too
    later = engine.rows_to_host_async(slot)
    weights_now = engine.weights_to_host_async(slot)
    for k in range(1, 4):  # the slot changes before either copy is read
        _train(engine, k)
    got: list[torch.Tensor] = []
    writer = threading.Thread(target=lambda: got.append(later()))
    writer.start()
    writer.join(60)
    assert got and got[0].shape == (len(SLOT_ROWS), engine.slot_width)
    assert torch.equal(got[0], want)
    assert torch.equal(weights_now(), want[:1])
    assert not torch.equal(engine.read_slot(slot)[:1], want[:1])  # it did train on


@pytest.mark.parametrize("numel", [1, 1000, 4096, 4097, 3 * 4096 + 5])  # under, at and over the chunk, odd tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_staging_equals_a_plain_copy(numel: int, dtype: torch.dtype) -> None:
    staging = PinnedStaging(torch.device("cuda"), chunk_bytes=4096)  # small chunks: many rounds of both buffers
    src = torch.randn(numel, device="cuda").to(dtype)
    ready = torch.cuda.Event()
    ready.record()
    got = staging.to_host(src, ready)
    assert got.device.type == "cpu" and got.dtype == dtype and torch.equal(got, src.cpu())
    grid = torch.randn(7, 333, device="cuda")
    assert torch.equal(staging.to_host(grid), grid.cpu())
    with pytest.raises(ValueError, match="contiguous"):
        staging.to_host(grid.t())
