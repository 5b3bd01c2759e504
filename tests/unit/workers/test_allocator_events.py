"""workers/engine/allocator_events.py where there is no CUDA allocator: every event reads zero (its CUDA counts are checked
in tests/gpu/test_allocator_events_cuda.py)."""

from __future__ import annotations

import torch

from loraplex.workers.engine.allocator_events import EVENTS, allocator_events


def test_the_cpu_has_no_allocator_events() -> None:
    assert allocator_events(torch.device("cpu")) == dict.fromkeys(EVENTS, 0)
