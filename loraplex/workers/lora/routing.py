"""Routing metadata for one microbatch, built once and read by every LoRA layer (no per-layer sort, gather or scatter).

Rows are the flattened [batch * seq] token dimension. The batch is laid out so each adapter's sequences are contiguous, so
adapter group g owns rows [ends[g-1], ends[g]) (ends[-1] == num_rows: every row belongs to a group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device. To CUDA through pinned memory without blocking: a plain (pageable, blocking) copy waits
    for the whole GPU queue, i.e. the previous microbatch's backward, and the host would lose its run-ahead every
    microbatch. The caching host allocator keeps the pinned block alive until the copy has completed."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class Routing:
    # Host copies: the reference loop slices with them and never syncs the device.
    slots: tuple[int, ...]  # bank slot per group
    ranks: tuple[int, ...]  # real rank per group (<= r_max)
    scales: tuple[float, ...]  # alpha / rank per group
    ends: tuple[int, ...]  # cumulative row ends per group
    # Device copies, for fused kernels (grouped_mm wants int32 cumulative offsets).
    slot_ids: torch.Tensor  # int64 [G]
    offs: torch.Tensor  # int32 [G]
    scale_values: torch.Tensor  # fp32 [G]
    # Per-row scale (the row's group scale), fp32 [N, 1]: the grouped op multiplies the rank-sized intermediate by it in
    # place (fp32 maths, one rounding to the activation dtype), so no layer repeats the repeat_interleave.
    row_scales: torch.Tensor

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        ranks: Sequence[int],
        scales: Sequence[float],
        group_rows: Sequence[int],
        device: str | torch.device = "cpu",
    ) -> Routing:
        if not (len(slots) == len(ranks) == len(scales) == len(group_rows)) or not slots:
            raise ValueError("routing needs one slot, rank, scale and row count per group, and at least one group")
        if any(int(n) < 0 for n in group_rows):
            raise ValueError(f"group row counts must be >= 0, got {list(group_rows)}")
        ends: list[int] = []
        total = 0
        for n in group_rows:
            total += int(n)
            ends.append(total)
        # All built on the host (repeat_interleave on the device would sync to learn its output size), then copied.
        scale_values = torch.tensor(list(scales), dtype=torch.float32)
        row_scales = torch.repeat_interleave(scale_values, torch.tensor([int(n) for n in group_rows])).view(-1, 1)
        device = torch.device(device)
        return cls(
            slots=tuple(int(s) for s in slots),
            ranks=tuple(int(r) for r in ranks),
            scales=tuple(float(a) for a in scales),
            ends=tuple(ends),
            slot_ids=to_device(torch.tensor(list(slots), dtype=torch.int64), device),
            offs=to_device(torch.tensor(ends, dtype=torch.int32), device),
            scale_values=to_device(scale_values, device),
            row_scales=to_device(row_scales, device),
        )

    @property
    def num_groups(self) -> int:
        return len(self.slots)

    @property
    def num_rows(self) -> int:
        return self.ends[-1]

    @property
    def starts(self) -> tuple[int, ...]:
        return (0, *self.ends[:-1])
