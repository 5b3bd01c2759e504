"""Seeded LoRA init: A kaiming-uniform (a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)) as PEFT draws it; B stays zero.

On the CPU each bank draws its [rank, in] block (PEFT's layout) from one CPU generator seeded by the adapter's seed, in
bank order. On an accelerator that costs too much for a create (a Qwen3-4B rank-32 adapter is ~29 M values: ~70 ms
of CPU drawing plus 252 host-to-device copies), so there the values come from the device's own generator, seeded the
same way, one draw per distinct fan-in, written into the banks in place. A seed therefore gives the same weights in
any slot and on every device of one kind, not across kinds (a checkpoint, not the seed, carries weights across).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def init_lora_a(banks: Sequence[Any], slot: int, rank: int, seed: int) -> None:
    """Write the init of a rank-`rank` adapter into `slot` of every bank's A (columns past `rank` untouched: the caller
    zeroed the slot). A bank's A is [S, in, r_max] (a dense layer) or [S, E, in, r_max] (an MoE's expert projection:
    each expert drawn as a dense layer of the same fan-in)."""
    device = banks[0].lora_A.device
    with torch.no_grad():
        if device.type == "cpu":
            gen = torch.Generator().manual_seed(seed)
            for bank in banks:
                bound = 1.0 / math.sqrt(bank.in_features)
                lead = tuple(bank.lora_A.shape[1:-2])  # () dense, (E,) experts
                a = torch.empty(*lead, rank, bank.in_features).uniform_(-bound, bound, generator=gen)
                bank.lora_A[slot, ..., :rank] = a.transpose(-1, -2)
            return
        gen = torch.Generator(device=device).manual_seed(seed)
        groups: dict[tuple[int, ...], list[Any]] = {}
        for bank in banks:
            groups.setdefault((*bank.lora_A.shape[1:-2], bank.in_features), []).append(bank)
        for key, members in groups.items():
            shape, fan_in = key[:-1], key[-1]
            bound = 1.0 / math.sqrt(fan_in)
            values = torch.empty(len(members), *shape, rank, fan_in, device=device).uniform_(
                -bound, bound, generator=gen
            )
            for bank, a in zip(members, values, strict=True):
                bank.lora_A[slot, ..., :rank].copy_(a.transpose(-1, -2))
