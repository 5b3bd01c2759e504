"""Device-to-host copies that never stall the training thread: through two small pinned buffers allocated once, on a
side stream, into pageable host memory.

Why not a pinned host tensor per copy: allocating pinned memory (cudaHostAlloc) holds the driver while it locks the
pages, and every other thread's CUDA calls wait; a plain `.cpu()` into pageable memory does the same for its whole
copy. On the H200 (benchmarks/probe_snapshot_stall.py, RESULTS.md 2026-12-04) a 1 GiB copy (one Qwen3-4B
adapter's four rows at rank 32) stalled a training loop on another thread for 653 ms through a fresh pinned tensor
and 1,024 ms through `.cpu()`; through these two 64 MiB buffers the loop's slowest iteration rose by < 8 ms, the
copy itself taking ~0.2 s in the calling thread. The plain reference is `src.cpu()` (tests/gpu/test_slot_copy_cuda.py).
"""

from __future__ import annotations

import threading

import torch

CHUNK_BYTES = 64 << 20


class PinnedStaging:
    """One per engine (CUDA only). `to_host` may be called from any thread; calls take turns (one lock)."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.stream = torch.cuda.Stream(device)
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._lock = threading.Lock()

    def to_host(self, src: torch.Tensor, ready: torch.cuda.Event | None = None) -> torch.Tensor:
        """A pageable host copy of the contiguous device tensor `src`, once `ready` (an event recorded where `src` was
        written) has passed; returns when the copy is complete."""
        if not src.is_contiguous():
            raise ValueError("PinnedStaging.to_host needs a contiguous tensor")
        out = torch.empty(src.shape, dtype=src.dtype)
        src_bytes, out_bytes = src.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        total = src_bytes.numel()
        pending: list[tuple[int, int] | None] = [None, None]  # per buffer: (offset, length) copied in, not yet out
        with self._lock, torch.cuda.device(self.device):
            if ready is not None:
                self.stream.wait_event(ready)
            for i, start in enumerate(range(0, total, self.chunk_bytes)):
                k = i % 2
                self._drain(k, pending, out_bytes)  # the buffer is free again once its last chunk is out
                length = min(self.chunk_bytes, total - start)
                with torch.cuda.stream(self.stream):
                    self._buffers[k][:length].copy_(src_bytes[start : start + length], non_blocking=True)
                    self._events[k].record(self.stream)
                pending[k] = (start, length)
            for k in range(2):
                self._drain(k, pending, out_bytes)  # every read of src is done: its memory may be reused at once
        return out

    def _drain(self, k: int, pending: list[tuple[int, int] | None], out_bytes: torch.Tensor) -> None:
        entry = pending[k]
        if entry is None:
            return
        start, length = entry
        self._events[k].synchronize()
        out_bytes[start : start + length].copy_(self._buffers[k][:length])
        pending[k] = None
