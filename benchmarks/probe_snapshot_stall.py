"""What in a durable snapshot stalls the training thread (RESULTS.md, 2026-12-04: 4 underfilled tenants at p99 1.2 s
through the service against 115 ms in the engine alone).

The main thread runs a training-like loop (many small kernel launches from Python plus a few large matmuls, synced
each iteration) and times every iteration; meanwhile a second thread does one snapshot-like action on a device
tensor of one adapter's state (Qwen3-4B at rank 32: four fp32 rows of 66 M values, ~1 GiB). Printed per action: the
loop's median iteration, its slowest, and how long the action took. Run on the GPU machine:

    python3 benchmarks/probe_snapshot_stall.py [--gib 1.0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

CHUNK = 64 << 20  # bytes per staged copy


def loop_iteration(x: torch.Tensor, w: torch.Tensor, small: torch.Tensor) -> None:
    for _ in range(200):  # launches from Python, as the eager parts of a step (the loss, the optimizer) are
        small.mul_(1.0001)
    for _ in range(4):
        x = x @ w
    torch.cuda.synchronize()


def pinned_fresh(state: torch.Tensor) -> None:
    """What the writer does today: a new pinned host tensor per snapshot, one async copy on a side stream."""
    side = torch.cuda.Stream()
    host = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        host.copy_(state, non_blocking=True)
    side.synchronize()


def pageable(state: torch.Tensor) -> None:
    state.cpu()


def staged(state: torch.Tensor, buffers: list[torch.Tensor]) -> None:
    """Through preallocated pinned chunks (two, alternating) into pageable host memory."""
    side = torch.cuda.Stream()
    flat = state.view(-1).view(torch.uint8)
    out = torch.empty(flat.numel(), dtype=torch.uint8)
    events = [torch.cuda.Event(), torch.cuda.Event()]
    pending: list[tuple[int, int, int] | None] = [None, None]
    for i, start in enumerate(range(0, flat.numel(), CHUNK)):
        k = i % 2
        if pending[k] is not None:
            events[k].synchronize()
            _, s, n = pending[k]
            out[s : s + n].copy_(buffers[k][:n])
        n = min(CHUNK, flat.numel() - start)
        with torch.cuda.stream(side):
            buffers[k][:n].copy_(flat[start : start + n], non_blocking=True)
            events[k].record(side)
        pending[k] = (k, start, n)
    for k in range(2):
        if pending[k] is not None:
            events[k].synchronize()
            _, s, n = pending[k]
            out[s : s + n].copy_(buffers[k][:n])


def write_fsync(host: torch.Tensor) -> None:
    fd, path = tempfile.mkstemp(dir=os.environ.get("PROBE_DIR", "/tmp"))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(host.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.unlink(path)


def measure(
    name: str, action: Callable[[], None] | None, x: torch.Tensor, w: torch.Tensor, small: torch.Tensor
) -> None:
    times: list[float] = []
    took: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        assert action is not None
        action()
        took.append(time.perf_counter() - t)

    worker = threading.Thread(target=run) if action is not None else None
    for i in range(60):
        if i == 10 and worker is not None:
            worker.start()
        t = time.perf_counter()
        loop_iteration(x, w, small)
        times.append(time.perf_counter() - t)
        if i > 10 and worker is not None and not worker.is_alive() and i > 30:
            break
    if worker is not None:
        worker.join()
    during = times[10:]
    print(f"{name:<34} loop median {statistics.median(times[:10]) * 1e3:6.1f} ms, during: median "
          f"{statistics.median(during) * 1e3:6.1f}, max {max(during) * 1e3:7.1f}; action {took[0] * 1e3 if took else 0:7.1f} ms",
          flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    x = torch.randn(4096, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 2560, device="cuda", dtype=torch.bfloat16) / 50
    small = torch.ones(1024, device="cuda")
    state = torch.randn(int(args.gib * (1 << 30)) // 4, device="cuda")
    buffers = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    host = state.cpu()
    for _ in range(3):
        loop_iteration(x, w, small)
    for r in range(args.repeats):
        print(f"-- repeat {r}")
        measure("nothing", None, x, w, small)
        measure("pinned tensor allocated + copied", lambda: pinned_fresh(state), x, w, small)
        measure("pageable .cpu()", lambda: pageable(state), x, w, small)
        measure("staged through 2 pinned chunks", lambda: staged(state, buffers), x, w, small)
        measure("write + fsync of the host copy", lambda: write_fsync(host), x, w, small)
        measure("device clone (torch.clone)", lambda: (state.clone(), torch.cuda.synchronize()), x, w, small)


if __name__ == "__main__":
    main()
