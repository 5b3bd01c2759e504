"""Slot banks: every target nn.Linear gets an A bank [S, in, r_max] and a B bank [S, r_max, out] (fp32 masters).

The base weight stays frozen. Every wrapped layer reads the routing of the current microbatch from one shared LoraContext.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from loraplex.errors import InvalidRequestError
from loraplex.workers.lora.context import LoraContext
from loraplex.workers.lora.expert_bank import EXPERT_PROJECTIONS, is_fused_experts
from loraplex.workers.lora.fused import BankLayout, MicrobatchBanks, lora_delta_fused
from loraplex.workers.lora.reference import lora_delta_reference
from loraplex.workers.lora.routing import Routing
from loraplex.workers.lora.siblings import SiblingGroup

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# (x [N, in], A bank, B bank, routing) -> delta [N, out]; a fused kernel can replace the reference loop per context.
LoraOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Routing], torch.Tensor]


class SlotBankLinear(nn.Module):
    """y = base(x) + LoRA delta of the row's adapter (see `lora_delta_reference` for the exact semantics)."""

    def __init__(self, base: nn.Linear, num_slots: int, max_rank: int, context: LoraContext, op: LoraOp | None = None):
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        device = base.weight.device
        # fp32 masters whatever the base dtype; compute casts to the activation dtype.
        self.lora_A = nn.Parameter(
            torch.zeros(num_slots, self.in_features, max_rank, device=device, dtype=torch.float32)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(num_slots, max_rank, self.out_features, device=device, dtype=torch.float32)
        )
        self.context = context  # a plain object, not a submodule: shared by all layers
        self.op: LoraOp = op or lora_delta_reference
        # Where the banks sit in the optimizer's flat buffer (set by the engine): the fused path reads the microbatch's
        # gathered banks (context.banks) through it instead of running `op` on the master banks.
        self.layout: BankLayout | None = None
        # The layers of the same module that read the same input (set by install_sibling_groups).
        self.siblings: SiblingGroup | None = None

    def fused_base_weight(self, x: torch.Tensor, banks: MicrobatchBanks) -> torch.Tensor | None:
        """The base weight when the base matmul fuses into the LoRA node (lora/fused.py: no separate adds over [N, out]
        or [N, in], one rounding of base + delta), else None. CUDA only: the CPU paths stay bit-comparable."""
        w = self.base.weight
        if x.is_cuda and self.base.bias is None and x.dtype == w.dtype == banks.compute.dtype:
            return w
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.context.routing
        if routing is None:
            return self.base(x)
        x2 = x.reshape(-1, self.in_features)
        banks = self.context.banks
        if banks is not None and self.layout is not None:
            base_weight = self.fused_base_weight(x, banks)
            out = None
            if self.siblings is not None and self.context.shared_inputs:
                out = self.siblings.output(self, x, banks, routing)  # q/k/v, gate/up: one node (lora/siblings.py)
            if out is None:
                out = lora_delta_fused(x2, self.layout, banks, routing, base_weight=base_weight)
            if base_weight is not None:
                return out.view(*x.shape[:-1], self.out_features)
            delta = out
        else:
            delta = self.op(x2, self.lora_A, self.lora_B, routing)
        y = self.base(x)
        return y + delta.view(y.shape)

    def extra_repr(self) -> str:
        slots, _, rank = self.lora_A.shape
        return f"in={self.in_features}, out={self.out_features}, slots={slots}, r_max={rank}"


def install_slot_banks(
    model: nn.Module,
    *,
    num_slots: int,
    max_rank: int,
    target_modules: Iterable[str] = DEFAULT_TARGET_MODULES,
    context: LoraContext,
    op: LoraOp | None = None,
) -> dict[str, SlotBankLinear]:
    """Freeze the base model and wrap every nn.Linear whose leaf name is in `target_modules` (in model order).
    Every wrapped layer computes its LoRA delta with `op` (default: `lora_delta_reference`; see `select_lora_op`).

    Unknown target names (matching no nn.Linear) are an InvalidRequestError, as is wrapping the output head: the loss
    calls the head's weight directly, so a LoRA there would be silently ignored."""
    targets = tuple(dict.fromkeys(target_modules))
    if not targets:
        raise InvalidRequestError("target_modules is empty")
    if num_slots < 1 or max_rank < 1:
        raise InvalidRequestError(f"need at least one slot and max_rank >= 1 (got {num_slots}, {max_rank})")
    hf: Any = model  # a transformers model: its get_* methods are not nn.Module's
    head = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: dict[str, tuple[nn.Module, str, nn.Linear]] = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name in targets and isinstance(child, nn.Linear):
                if child is head:
                    raise InvalidRequestError(f"cannot put LoRA on the output head {child_name!r}")
                found[f"{name}.{child_name}" if name else child_name] = (module, child_name, child)
    # gate/up/down of an MoE's fused experts get expert banks (lora/expert_bank.py, installed after this function)
    experts = EXPERT_PROJECTIONS if any(is_fused_experts(m) for m in model.modules()) else ()
    missing = [t for t in targets if t not in experts and not any(n.rsplit(".", 1)[-1] == t for n in found)]
    if missing:
        raise InvalidRequestError(
            f"unknown target modules {missing}: no nn.Linear (or fused experts' projection) with that name in the model"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    banks: dict[str, SlotBankLinear] = {}
    for full_name, (parent, child_name, linear) in found.items():
        wrapped = SlotBankLinear(linear, num_slots, max_rank, context, op)
        setattr(parent, child_name, wrapped)
        banks[full_name] = wrapped
    return banks


def _is_bank(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def base_parameters(model: nn.Module) -> tuple[nn.Parameter, ...]:
    """Every parameter that is not a LoRA bank: the frozen base."""
    return tuple(p for name, p in model.named_parameters() if not _is_bank(name))


def check_only_lora_trainable(model: nn.Module) -> None:
    """Raise InvalidRequestError if any trainable parameter is not a LoRA bank (a base weight must never train)."""
    bad = [name for name, p in model.named_parameters() if p.requires_grad and not _is_bank(name)]
    if bad:
        raise InvalidRequestError(f"non-LoRA parameters are trainable: {bad[:5]}{' ...' if len(bad) > 5 else ''}")
