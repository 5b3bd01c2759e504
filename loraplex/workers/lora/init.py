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

import torch

from loraplex.workers.lora.slot_bank import SlotBankLinear


def init_lora_a(banks: Sequence[SlotBankLinear], slot: int, rank: int, seed: int) -> None:
    """Write the init of a rank-`rank` adapter into `slot` of every bank's A (columns past `rank` untouched: the caller
    zeroed the slot)."""
    device = banks[0].lora_A.device
    with torch.no_grad():
        if device.type == "cpu":
            gen = torch.Generator().manual_seed(seed)
            for bank in banks:
                bound = 1.0 / math.sqrt(bank.in_features)
                a = torch.empty(rank, bank.in_features).uniform_(-bound, bound, generator=gen)
                bank.lora_A[slot, :, :rank] = a.t()
            return
        gen = torch.Generator(device=device).manual_seed(seed)
        groups: dict[int, list[SlotBankLinear]] = {}
        for bank in banks:
            groups.setdefault(bank.in_features, []).append(bank)
        for fan_in, members in groups.items():
            bound = 1.0 / math.sqrt(fan_in)
            values = torch.empty(len(members), rank, fan_in, device=device).uniform_(-bound, bound, generator=gen)
            for bank, a in zip(members, values, strict=True):
                bank.lora_A[slot, :, :rank].copy_(a.t())
