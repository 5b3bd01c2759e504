"""Slot banks and the LoRA ops (plain-torch reference; the grouped_mm and fused per-microbatch paths are tested against
it; select_lora_op picks the kernel)."""

from loraplex.workers.lora.context import LoraContext
from loraplex.workers.lora.fused import BankLayout, MicrobatchBanks, lora_delta_fused
from loraplex.workers.lora.grouped import lora_delta_grouped
from loraplex.workers.lora.ops import select_lora_op
from loraplex.workers.lora.reference import lora_delta_reference, lora_delta_single
from loraplex.workers.lora.routing import Routing
from loraplex.workers.lora.siblings import SiblingGroup, install_sibling_groups, lora_siblings_fused
from loraplex.workers.lora.slot_bank import (
    DEFAULT_TARGET_MODULES,
    LoraOp,
    SlotBankLinear,
    base_parameters,
    check_only_lora_trainable,
    install_slot_banks,
)

__all__ = [
    "BankLayout",
    "MicrobatchBanks",
    "lora_delta_fused",
    "DEFAULT_TARGET_MODULES",
    "LoraContext",
    "LoraOp",
    "Routing",
    "SiblingGroup",
    "SlotBankLinear",
    "base_parameters",
    "check_only_lora_trainable",
    "install_sibling_groups",
    "install_slot_banks",
    "lora_delta_grouped",
    "lora_delta_reference",
    "lora_delta_single",
    "lora_siblings_fused",
    "select_lora_op",
]
