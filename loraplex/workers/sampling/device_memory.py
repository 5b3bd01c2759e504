"""How much memory a device has free for the sampler to take (its KV cache, a base-model replica): measured once at
pool start, after the engine is built."""

from __future__ import annotations

import os

import torch


def free_bytes(device: torch.device) -> int:
    """CUDA: the driver's free memory plus what torch's caching allocator holds unused (it is this process's to
    reuse). CPU: the host's MemAvailable (all of it shared with everything else on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + unused
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: the pages the OS reports available
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
