"""Routing metadata for one microbatch, built once and read by every LoRA layer (no per-layer sort, gather or scatter).

Rows are the flattened [batch * seq] token dimension. The batch is laid out so each adapter's sequences are contiguous, so
adapter group g owns rows [ends[g-1], ends[g]) (ends[-1] == num_rows: every row belongs to a group).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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
        ends: list[int] = []
        total = 0
        for n in group_rows:
            total += int(n)
            ends.append(total)
        return cls(
            slots=tuple(int(s) for s in slots),
            ranks=tuple(int(r) for r in ranks),
            scales=tuple(float(a) for a in scales),
            ends=tuple(ends),
            slot_ids=torch.tensor(list(slots), dtype=torch.int64, device=device),
            offs=torch.tensor(ends, dtype=torch.int32, device=device),
            scale_values=torch.tensor(list(scales), dtype=torch.float32, device=device),
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


class LoraContext:
    """Shared by every wrapped layer of one model: the current microbatch's routing (None = base model only)."""

    def __init__(self) -> None:
        self.routing: Routing | None = None

    @contextmanager
    def use(self, routing: Routing | None) -> Iterator[None]:
        previous, self.routing = self.routing, routing
        try:
            yield
        finally:
            self.routing = previous
