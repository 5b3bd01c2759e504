"""What `build_engine` (build.py) hands the Engine: the model with every technique applied, and the pieces the
training path reads. Kept apart from build.py so that engine.py needs only the types, never the build."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from loraplex.workers.engine.body_graphs import BodyGraphs
from loraplex.workers.engine.optimizer import SlotAdamW
from loraplex.workers.engine.pinned_staging import PinnedStaging
from loraplex.workers.engine.trunk import Trunk
from loraplex.workers.kernels.fused_elementwise import active as fused_elementwise_active
from loraplex.workers.lora import LoraContext, SiblingGroup, SlotBankLinear
from loraplex.workers.lora.expert_bank import ExpertProjectionBank
from loraplex.workers.ranks.distributed import RankGroup


class FusedElementwise:
    """The fused norm / activation kernels installed on the model (`installed` modules; 0: none) and whether training
    microbatches use them (`on`, flippable between calls where installed). Read by the engine's eager microbatches
    and by the CUDA graphs when they capture."""

    def __init__(self, installed: int) -> None:
        self.installed = installed
        self.on = bool(installed)

    @property
    def used(self) -> bool:
        return bool(self.on and self.installed)

    def active(self) -> AbstractContextManager[None]:
        """The kernels on for the block where the engine has them and wants them."""
        return fused_elementwise_active() if self.used else nullcontext()


@dataclass
class EngineParts:
    model: nn.Module  # the base model on its device, in eval mode, frozen, with the slot banks in place
    device: torch.device
    compute_dtype: torch.dtype  # the activations' dtype: banks are cast to it
    context: LoraContext  # shared by every wrapped layer: the current microbatch's routing and banks
    # Every LoRA bank by full module name: dense ones first (their columns lead the optimizer's flat buffer).
    banks: dict[str, SlotBankLinear | ExpertProjectionBank]
    dense_width: int  # the dense banks' columns of the flat [S, P] buffer: what the fused path gathers
    fused_grouped: bool  # several groups run through grouped_mm on the fused path (else the reference loop)
    fused_lora: bool  # the fused path on at the start (flippable)
    optimizer: SlotAdamW  # the banks' flat fp32 masters, gradients and Adam state
    sibling_groups: list[SiblingGroup]
    body: nn.Module  # embeddings -> layers -> final norm
    head: nn.Module  # the LM head (only its weight is read)
    trunk: Trunk  # body + chunked head as one module (FSDP2's root unit)
    vocab_size: int
    pad_id: int
    elementwise: FusedElementwise
    graphs: BodyGraphs | None  # None where CUDA graphs cannot apply
    cuda_graphs: bool  # graphs used at the start (flippable where `graphs` is set)
    staging: PinnedStaging | None  # pinned host buffers for slot copies (CUDA only)
    group: RankGroup | None  # None: one process; else this rank of the pool
    shard_base: bool  # with a group: base weights sharded with FSDP2
