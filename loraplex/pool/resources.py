"""What the pool reads of its machine for its metrics and the dashboard (pool/metrics.RESOURCES): the rank-0 process's
resident memory, its device's memory (through the engine's `device_memory`, workers/engine/device_memory.py) and the
checkpoint store's file system. Each reading that fails is left out (unknown), never raised."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path


def host_memory_bytes() -> int | None:
    """Resident set size of this process (Linux's /proc; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def resource_reader(blob_root: Path, device_memory: Callable[[], Mapping[str, int]] | None = None
                    ) -> Callable[[], dict[str, float]]:  # fmt: skip
    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        rss = host_memory_bytes()
        if rss is not None:
            out["host_memory_bytes"] = rss
        if device_memory is not None:
            for kind, value in device_memory().items():
                out[f"gpu_memory_{kind}_bytes"] = value
        try:
            usage = shutil.disk_usage(blob_root if blob_root.exists() else blob_root.parent)
            out["checkpoint_disk_free_bytes"], out["checkpoint_disk_size_bytes"] = usage.free, usage.total
        except OSError:  # the blob root unreadable: the reading goes without the disk numbers, the rest still counts
            pass
        return out

    return read
