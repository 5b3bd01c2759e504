"""One typed build of the training engine, as torchtitan builds a model: `build_engine(model, config, device, group)`
applies each technique to the base model in a fixed order, each a small function below, and hands the Engine its
parts (parts.py). The order, and why it is that order:

 1. place        the model on its device (the rank's with a group), eval mode (no dropout; LoRA has none either)
 2. attention    sdpa replaced by the packed attention, which is sdpa itself for every unpacked call
 3. LoRA op      the per-layer op and whether the fused path is on (both read the device and dtype)
 4. slot banks   dense SlotBankLinears, then an MoE's expert banks: this freezes the base (everything after sees the
                 banks as the only trainable parameters) and fixes the bank order the optimizer's flat buffer follows
 5. optimizer    SlotAdamW over the banks (the flat buffers), then each dense bank's layout in them (fused path)
 6. siblings     q/k/v and gate/up grouped, to share their A product on the fused path; their frozen base weights
                 stacked in one buffer each (stacked_weights.py: the sampler's decode runs one product per group),
                 except where FSDP shards the base (its layout, not ours)
 7. staging      pinned host buffers for slot copies, allocated now so none is allocated while the pool trains
 8. check        only LoRA banks are trainable
 9. elementwise  the fused norm / activation kernels installed where asked and available
10. trunk        body + chunked LM head as one module
11. CUDA graphs  the runner of the decoder body (reads the trunk, the context and the elementwise switch)
12. recompute    each decoder layer's forward made able to recompute in the backward (switched per microbatch)
13. FSDP2        last: the base weights sharded per decoder layer, the trunk the root (the banks stay replicated);
                 every module swap above happens on the whole, unsharded model
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraplex.workers.engine.body_graphs import BodyGraphs
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.optimizer import SlotAdamW
from loraplex.workers.engine.parts import EngineParts, FusedElementwise
from loraplex.workers.engine.pinned_staging import PinnedStaging
from loraplex.workers.engine.recompute import wrap_layers
from loraplex.workers.engine.stacked_weights import stack_all
from loraplex.workers.engine.trunk import Trunk
from loraplex.workers.kernels.fused_elementwise import available as fused_elementwise_available
from loraplex.workers.kernels.fused_elementwise import install as install_fused_elementwise
from loraplex.workers.kernels.packed_attention import install_packed_attention
from loraplex.workers.lora import (
    BankLayout,
    LoraContext,
    LoraOp,
    SiblingGroup,
    SlotBankLinear,
    check_only_lora_trainable,
    install_sibling_groups,
    install_slot_banks,
    lora_delta_grouped,
    select_lora_op,
)
from loraplex.workers.lora.expert_bank import ExpertProjectionBank, install_expert_banks
from loraplex.workers.ranks.distributed import RankGroup, shard_base_model


def build_engine(
    model: nn.Module,
    config: EngineConfig | None = None,
    device: str | torch.device | None = None,
    group: RankGroup | None = None,
) -> Engine:
    """The engine of `model` (a transformers causal LM) as `config` says. device: where it runs (None: where the
    model's parameters are); with `group` (one rank of a pool), the group's device, and the base weights sharded with
    FSDP2 unless `config.shard_base` is False."""
    config = config or EngineConfig()
    model, where = place(model, device, group)
    install_packed_attention(model)
    compute_dtype = next(model.parameters()).dtype
    op, fused_lora, fused_grouped = choose_lora_op(config, where, compute_dtype)
    context = LoraContext()
    dense, experts = attach_slot_banks(model, config, context, op, fused_grouped)
    banks: dict[str, SlotBankLinear | ExpertProjectionBank] = {**dense, **experts}
    optimizer, dense_width = slot_optimizer(banks, dense, config)
    siblings = group_siblings(dense, context, config)
    if group is None or not config.shard_base:
        stack_all([[dense_bank.base for dense_bank in g.members if isinstance(dense_bank, SlotBankLinear)]
                   for g in siblings])  # fmt: skip
    staging = PinnedStaging(where) if where.type == "cuda" else None
    check_only_lora_trainable(model)
    elementwise = FusedElementwise(fuse_elementwise(model, config, where))
    hf: Any = model  # a transformers model: its get_* methods are not nn.Module's
    body, head = hf.get_decoder(), hf.get_output_embeddings()
    trunk = Trunk(body, head)
    graphs = graph_runner(trunk, context, dense_width, compute_dtype, where, elementwise, config, group, fused_grouped)
    wrap_layers(body.layers)  # activation recomputation, switched per microbatch by config.recompute
    if group is not None and config.shard_base:
        shard_base_model(trunk, body.layers, optimizer.params, group.mesh)
    vocab_size = int(head.weight.shape[0])
    pad = getattr(hf.config, "pad_token_id", None)
    parts = EngineParts(
        model=model, device=where, compute_dtype=compute_dtype, context=context, banks=banks, dense_width=dense_width,
        fused_grouped=fused_grouped, fused_lora=fused_lora, optimizer=optimizer, sibling_groups=siblings, body=body,
        head=head, trunk=trunk, vocab_size=vocab_size,
        pad_id=int(pad) if isinstance(pad, int) and 0 <= pad < vocab_size else 0,
        elementwise=elementwise, graphs=graphs, cuda_graphs=config.cuda_graphs is not False and graphs is not None,
        staging=staging, group=group, shard_base=config.shard_base,
    )  # fmt: skip
    return Engine(parts, config)


def place(
    model: nn.Module, device: str | torch.device | None, group: RankGroup | None
) -> tuple[nn.Module, torch.device]:
    """1. The model on its device in eval mode: the group's device for one rank of a pool, else `device`, else where
    the model's parameters already are."""
    if group is not None:
        device = group.device
    where = torch.device(device) if device is not None else next(model.parameters()).device
    return model.to(where).eval(), where


def choose_lora_op(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> tuple[LoraOp, bool, bool]:
    """3. (the unfused path's op, the fused path on, several groups through grouped_mm on the fused path)."""
    op = config.lora_op or select_lora_op(device, dtype)  # grouped_mm where it is faster
    fused_lora = config.lora_op is None if config.fused_lora is None else bool(config.fused_lora)
    return op, fused_lora, op is lora_delta_grouped


def attach_slot_banks(
    model: nn.Module, config: EngineConfig, context: LoraContext, op: LoraOp, grouped: bool
) -> tuple[dict[str, SlotBankLinear], dict[str, ExpertProjectionBank]]:
    """4. Slot banks on every target layer (freezing the base), then expert banks on an MoE's fused experts."""
    dense = install_slot_banks(
        model, num_slots=config.num_slots, max_rank=config.max_rank, target_modules=config.target_modules,
        context=context, op=op,
    )  # fmt: skip
    experts = install_expert_banks(
        model, num_slots=config.num_slots, max_rank=config.max_rank, targets=config.target_modules, context=context,
        grouped=grouped,
    )  # fmt: skip
    return dense, experts


def slot_optimizer(
    banks: dict[str, SlotBankLinear | ExpertProjectionBank], dense: dict[str, SlotBankLinear], config: EngineConfig
) -> tuple[SlotAdamW, int]:
    """5. Batched AdamW over every bank's A and B (in bank order: the dense banks' columns lead the flat buffer, so
    the fused path gathers only them), each dense bank told where it sits; returns it and the dense banks' width."""
    params, rank_dims = [], []
    for bank in banks.values():
        params += [bank.lora_A, bank.lora_B]
        lead = bank.lora_A.dim() - 3  # 0 dense; 1 experts ([S, E, in, r])
        rank_dims += [2 + lead, 1 + lead]  # A [S, (E,) in, r]: rank last; B [S, (E,) r, out]: rank second to last
    optimizer = SlotAdamW(params, rank_dims, config.num_slots)
    for i, bank in enumerate(dense.values()):
        (a_start, _), (b_start, _) = optimizer.segments[2 * i], optimizer.segments[2 * i + 1]
        bank.layout = BankLayout(a_start, b_start, bank.in_features, bank.out_features, config.max_rank)
    # The fused path's gathered width: the dense banks' columns (an MoE's expert banks are read in place).
    return optimizer, sum(n for _, n in optimizer.segments[: 2 * len(dense)])


def group_siblings(
    dense: dict[str, SlotBankLinear], context: LoraContext, config: EngineConfig
) -> list[SiblingGroup]:
    """6. The layers that read one input, grouped; the shared-input path on unless the config turns it off."""
    groups = install_sibling_groups(dense)
    context.shared_inputs = True if config.shared_lora_inputs is None else bool(config.shared_lora_inputs)
    return groups


def fuse_elementwise(model: nn.Module, config: EngineConfig, device: torch.device) -> int:
    """9. The fused norm / activation kernels installed (on by default where triton and CUDA are: measured on the H200,
    benchmarks/RESULTS.md); returns the modules installed (0: none)."""
    wanted = config.fused_elementwise is None or config.fused_elementwise
    if wanted and device.type == "cuda" and fused_elementwise_available():
        return install_fused_elementwise(model)
    return 0


def graph_runner(
    trunk: Trunk, context: LoraContext, dense_width: int, dtype: torch.dtype, device: torch.device,
    elementwise: FusedElementwise, config: EngineConfig, group: RankGroup | None, graphable_lora: bool,
) -> BodyGraphs | None:  # fmt: skip
    """11. The CUDA-graph runner of the decoder body, where graphs apply: CUDA, one rank or a replicated base (a sharded
    forward has collectives) and the fused grouped LoRA path (an MoE's expert LoRA included: lora/experts.py)."""
    if device.type != "cuda" or (group is not None and config.shard_base) or not graphable_lora:
        return None
    return BodyGraphs(
        trunk.hidden, context, dense_width, dtype, config.max_rank, device, elementwise.active,
        microbatch_tokens=config.microbatch_tokens,
    )  # fmt: skip
