"""The device's memory as the pool reports it (pool/resources.py): allocated (live tensors), reserved (held by the
caching allocator) and total (the device's). Nothing on the CPU: its memory is the process's, reported apart."""

from __future__ import annotations

import torch


def device_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    _, total = torch.cuda.mem_get_info(device)
    return {"allocated": int(torch.cuda.memory_allocated(device)), "reserved": int(torch.cuda.memory_reserved(device)),
            "total": int(total)}  # fmt: skip
