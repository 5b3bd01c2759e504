"""Per-slot LoRA banks on a mixture-of-experts block's fused experts (the maths: lora/experts.py).

`SlotBankExperts` takes the place of transformers' experts module (Qwen3-MoE's `mlp.experts`: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], frozen) and owns one `ExpertProjectionBank` per projection the pool targets
(`gate_proj`, `up_proj`, `down_proj`, named `<experts>.gate_proj` etc., so an adapter's target modules and a
checkpoint's module names read as a dense model's): lora_A [S, E, in, r_max], lora_B [S, E, r_max, out], fp32 masters
in the optimizer's flat buffer like the dense banks. A projection the pool does not target has no bank (no LoRA).

The expert banks are read by their layer from the masters, only the microbatch's slots (their gradients go into the
optimizer's flat gradient views: in place, by the grouped path's `_BankStack`, when the microbatch has the fused path's
trigger, so a CUDA graph's backward computes them too); they are not on the dense layers' gather-once path
(lora/fused.py), which would copy every slot's expert banks (3.3 GB per slot for Qwen3-30B-A3B at rank 16) into a
[G, P] buffer each microbatch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from loraplex.workers.lora.context import LoraContext
from loraplex.workers.lora.experts import MAX_GROUPS, ExpertBanks, experts_grouped, experts_reference

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExpertProjectionBank(nn.Module):
    """One expert projection's banks: lora_A [S, E, in, r_max], lora_B [S, E, r_max, out] (zero: no adapter)."""

    def __init__(self, num_slots: int, num_experts: int, in_features: int, out_features: int, max_rank: int,
                 device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.lora_A = nn.Parameter(torch.zeros(num_slots, num_experts, in_features, max_rank, device=device))
        self.lora_B = nn.Parameter(torch.zeros(num_slots, num_experts, max_rank, out_features, device=device))

    def extra_repr(self) -> str:
        slots, experts, _, rank = self.lora_A.shape
        return f"experts={experts}, in={self.in_features}, out={self.out_features}, slots={slots}, r_max={rank}"


class SlotBankExperts(nn.Module):
    """A fused-experts module with per-slot LoRA on its projections (module doc); forward as the experts module's:
    (hidden [N, H], top_k_index [N, K], top_k_weights [N, K]) -> [N, H]."""

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int, context: LoraContext,
                 projections: Iterable[str], grouped: bool) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        gate_up = cast(torch.Tensor, base.gate_up_proj)
        experts, two_inter, hidden = gate_up.shape
        inter = two_inter // 2
        shapes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        device = gate_up.device
        for name in projections:
            self.add_module(name, ExpertProjectionBank(num_slots, experts, *shapes[name], max_rank, device))
        self.context = context  # a plain object, shared by all layers
        self.grouped = grouped  # grouped_mm fast path, else the reference loop
        self.max_groups = MAX_GROUPS  # grouped_mm's group limit (experts.py: more run in chunks)

    def projection_banks(self) -> dict[str, ExpertProjectionBank]:
        return {n: m for n in EXPERT_PROJECTIONS if isinstance(m := getattr(self, n, None), ExpertProjectionBank)}

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        routing = self.context.routing
        if routing is None:
            return self.base(hidden_states, top_k_index, top_k_weights)
        own = self.projection_banks()
        pairs = [(own[n].lora_A, own[n].lora_B) if n in own else (None, None) for n in EXPERT_PROJECTIONS]
        banks = ExpertBanks(*(t for pair in pairs for t in pair))
        base: Any = self.base
        args = (hidden_states, top_k_index, top_k_weights, base.gate_up_proj, base.down_proj, banks, routing, base.act_fn)
        if not self.grouped:
            return experts_reference(*args)
        # A training microbatch on the fused path has a trigger: the banks' gradients then go into their .grad in
        # place, which a CUDA graph's backward (asked for the trigger only) also runs.
        trigger = self.context.banks.trigger if self.context.banks is not None else None
        return experts_grouped(*args, max_groups=self.max_groups, trigger=trigger if torch.is_grad_enabled() else None)


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts layout: 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I] parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3
        and getattr(module, "act_fn", None) is not None
    )  # fmt: skip


def install_expert_banks(model: nn.Module, *, num_slots: int, max_rank: int, targets: Iterable[str],
                         context: LoraContext, grouped: bool) -> dict[str, ExpertProjectionBank]:  # fmt: skip
    """Wrap every fused-experts module of `model` whose projections `targets` names; returns the projection banks by
    full name (`<experts module>.<projection>`), in model order. The base weights must be frozen by the caller."""
    wanted = [p for p in EXPERT_PROJECTIONS if p in set(targets)]
    if not wanted:
        return {}
    found = [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]
    banks: dict[str, ExpertProjectionBank] = {}
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = SlotBankExperts(module, num_slots, max_rank, context, wanted, grouped)
        setattr(parent, child, wrapped)
        for projection, bank in wrapped.projection_banks().items():
            banks[f"{name}.{projection}"] = bank
    return banks
