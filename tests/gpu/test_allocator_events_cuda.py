"""workers/engine/allocator_events.py on CUDA: a cudaMalloc, a cudaFree and a retry are each counted when they happen."""

from __future__ import annotations

import pytest
import torch

from loraplex.workers.engine.allocator_events import allocator_events

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_malloc_free_and_a_retry_are_counted() -> None:
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = allocator_events(device)
    x = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # no cached block holds 256 MiB: a cudaMalloc
    after_alloc = allocator_events(device)
    assert after_alloc["device_alloc"] == before["device_alloc"] + 1
    del x
    torch.cuda.empty_cache()  # the cached block goes back to the driver: a cudaFree
    assert allocator_events(device)["device_free"] >= after_alloc["device_free"] + 1

    # A retry: fill the device with cached-but-free blocks, then ask for one block none of them fits.
    free, _ = torch.cuda.mem_get_info(device)
    chunk = 1 << 30
    held = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(int(free * 0.9) // chunk)]
    del held  # cached by the allocator, not returned
    retries = allocator_events(device)["alloc_retry"]
    big = torch.empty(int(free * 0.5), dtype=torch.uint8, device=device)  # fits the device only once the cache is freed
    assert allocator_events(device)["alloc_retry"] == retries + 1
    del big
    torch.cuda.empty_cache()

