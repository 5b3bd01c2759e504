"""The LoRA init on CUDA (drawn on the device, lora/init.py): kaiming-bounded, B zero, the same for one seed in any
slot, different for another seed, and the slot's other columns zero."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_init_is_seeded_bounded_and_slot_independent(tiny_dir: Path) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent, dtype=torch.bfloat16, device="cuda")
    engine = build_engine(model, EngineConfig(num_slots=3, max_rank=8), "cuda")
    engine.create_adapter("x", 4, 8.0, seed=42)
    engine.create_adapter("y", 4, 8.0, seed=42)
    engine.create_adapter("z", 4, 8.0, seed=43)
    wx, wy, wz = (engine.adapter_weights(m) for m in "xyz")
    for name, (a, b) in wx.items():
        bound = a.shape[0] ** -0.5
        assert torch.equal(a, wy[name][0]) and not torch.equal(a, wz[name][0])
        assert torch.count_nonzero(b) == 0 and a.abs().max() <= bound and a.abs().max() > 0.8 * bound
        assert abs(a.mean().item()) < 0.1 * bound
    slot = engine.adapter("x").slot
    assert all(torch.count_nonzero(bank.lora_A[slot, :, 4:]) == 0 for bank in engine.banks.values())
