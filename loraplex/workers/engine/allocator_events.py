"""The CUDA caching allocator's expensive events so far, for the pool's metrics and its slow-plan log line.

A cudaMalloc or cudaFree synchronizes the device, and a retry means the allocator found no cached block big enough,
freed every cached block it could and asked the driver again: each costs milliseconds, and a run of them during a plan
(memory near full, or shapes the cache never saw) is one reason a plan takes a second instead of 100 ms."""

from __future__ import annotations

import torch

EVENTS = ("device_alloc", "device_free", "alloc_retry")
_STAT_KEYS = {"device_alloc": "num_device_alloc", "device_free": "num_device_free", "alloc_retry": "num_alloc_retries"}


def allocator_events(device: torch.device) -> dict[str, int]:
    """event -> count since the process started, on `device`; all zero where there is no CUDA allocator (the CPU)."""
    if device.type != "cuda":
        return dict.fromkeys(EVENTS, 0)
    stats = torch.cuda.memory_stats(device)
    return {event: int(stats.get(key, 0)) for event, key in _STAT_KEYS.items()}
