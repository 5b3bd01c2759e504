"""A whole copy of a sharded pool's frozen base model, for sampling on every rank without a collective per decode step.

Why a replica: under FSDP2 (`pool_layout = "fsdp"`) each rank holds 1/N of every base weight, and a forward through
the sharded model all-gathers each layer's weights. Training pays that once per microbatch of thousands of tokens; a
decode step processes one token per row, so it would move the whole model across ranks for every generated token
(Qwen3-4B shape, bf16: ~8 GB per step, ~20 ms at 400 GB/s over NVLink against ~2 ms of reading the weights from HBM)
and hold every rank in lock step. So each rank keeps, beside its shards, the base model whole (in the compute dtype,
frozen: it never needs refreshing) and decodes its own share of the rows alone (workers/ranks/sampling.py); the LoRA
banks (dense and an MoE's expert banks) are replicated on every rank anyway (ignored by FSDP), so the replica's LoRA
layers read the training banks themselves: the same slots, the same sampler copies, no copy of the adapters.

Memory: one more whole base per rank (Qwen3-4B shape in bf16: ~8 GB; on a CPU pool, the fp32 tiny model: a few MB).
`check_fits` refuses a replica larger than `max_fraction` of the memory the device has free (CUDA: mem_get_info; CPU:
MemAvailable), so a pool whose base only fits sharded samples nothing (a clear error per request) instead of running
out of memory; `pool_layout = "replicate"` needs no replica (every rank holds the base whole already).

How: the base model is loaded again by the pool's own loader (deterministic: a folder, or a seeded preset), each of
its weights checked against this rank's FSDP shard of it (a local comparison, no collective), then given the
training engine's slot-bank wrappers (new `SlotBankLinear`s over the replica's Linears and `SlotBankExperts` over its
fused experts, sharing the training banks' Parameters, layout and routing context; sibling groups and the fused norm
/ activation kernels installed as build_engine installs them). `ReplicaEngine` is the training engine seen through it: model, body and head
are the replica's, everything else (adapters, optimizer, banks, routing context) the training engine's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from loraplex.errors import CapacityError, EngineError
from loraplex.workers.engine.build import fuse_elementwise
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.stacked_weights import stack_all
from loraplex.workers.kernels.packed_attention import install_packed_attention
from loraplex.workers.lora.expert_bank import SlotBankExperts
from loraplex.workers.lora.siblings import install_sibling_groups
from loraplex.workers.lora.slot_bank import SlotBankLinear
from loraplex.workers.ranks.distributed import is_sharded
from loraplex.workers.sampling.device_memory import free_bytes

ModelLoader = Callable[[torch.device], nn.Module]


class ReplicaEngine:
    """The training engine with a whole (unsharded) base model: `model`, `body` and `head` are the replica's and
    `shard_base` is False; every other attribute is read from the training engine each time (so adapters created,
    moved or trained since are seen as they are)."""

    def __init__(self, engine: Engine, model: nn.Module) -> None:
        hf: Any = model
        self.training = engine
        self.model = model
        self.body = hf.get_decoder()
        self.head = hf.get_output_embeddings()
        self.shard_base = False
        self.graphs = None  # the training engine's CUDA graphs run its own (sharded) body

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["training"], name)


def base_parameters(engine: Engine) -> list[tuple[str, torch.Tensor]]:
    """The frozen base weights of the training model (not the LoRA banks), by name, as the training model holds them
    (DTensors under FSDP2)."""
    lora = {id(p) for bank in engine.banks.values() for p in (bank.lora_A, bank.lora_B)}
    return [(n, p) for n, p in engine.model.named_parameters() if id(p) not in lora]


def replica_bytes(engine: Engine) -> int:
    """Bytes of a whole copy of the base model (global shapes, the compute dtype)."""
    return sum(p.numel() * p.element_size() for _, p in base_parameters(engine))


def check_fits(engine: Engine, max_fraction: float) -> None:
    """CapacityError unless a replica takes at most `max_fraction` of the device's free memory."""
    need, free = replica_bytes(engine), free_bytes(engine.device)
    if need > max_fraction * free:
        raise CapacityError(
            f"a whole copy of the base model for sampling needs {need / 2**30:.2f} GiB, more than "
            f"{max_fraction:g} of the {free / 2**30:.2f} GiB free on {engine.device} "
            "(LORAPLEX_SAMPLER_REPLICA_FRACTION; or pool_layout=replicate, or the vLLM sampler)"
        )


def build_replica(engine: Engine, load_model: ModelLoader, max_fraction: float = 1.0) -> Engine:
    """The training engine seen through a whole copy of its base model (see the module docstring). CapacityError when
    it does not fit, EngineError for weights that differ from the training model's."""
    check_fits(engine, max_fraction)
    model = load_model(engine.device).eval().requires_grad_(False)
    install_packed_attention(model)  # as build_engine: the prefill's attention is the training forward's
    check_same_weights(engine, model)
    wrapped: dict[str, SlotBankLinear] = {}
    for name, bank in engine.banks.items():
        if not isinstance(bank, SlotBankLinear):
            continue  # an expert projection's bank: its experts module is wrapped below
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, leaf)
        if not isinstance(base, nn.Linear):
            raise EngineError(f"the replica's {name} is not a Linear layer")
        # Zero slots of its own: the training bank's Parameters take their place (shared, never copied).
        layer = SlotBankLinear(base, 0, engine.max_rank, engine.context, bank.op)
        layer.lora_A, layer.lora_B, layer.layout = bank.lora_A, bank.lora_B, bank.layout
        setattr(parent, leaf, layer)
        wrapped[name] = layer
    for name, module in list(engine.model.named_modules()):
        if isinstance(module, SlotBankExperts):  # an MoE's fused experts: the same, per expert projection
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            projections = module.projection_banks()
            experts = SlotBankExperts(getattr(parent, leaf), 0, engine.max_rank, engine.context, projections,
                                      module.grouped)  # fmt: skip
            for projection, bank in projections.items():
                own = experts.projection_banks()[projection]
                own.lora_A, own.lora_B = bank.lora_A, bank.lora_B
            setattr(parent, leaf, experts)
    if engine.sibling_groups:
        groups = install_sibling_groups(wrapped)
        # its own base weights stacked as the training engine's are (workers/engine/build.py): the decode step runs the
        # same products, so the same tokens come out at any world size
        stack_all([[m.base for m in g.members if isinstance(m, SlotBankLinear)] for g in groups])
    if engine.fused_modules:  # the fused norm / activation kernels, on where the training model has them
        fuse_elementwise(model, engine.config, engine.device)
    return cast(Engine, ReplicaEngine(engine, model))


def check_same_weights(engine: Engine, model: nn.Module) -> None:
    """EngineError unless every base weight of `model` equals the training model's: its whole value for a plain
    tensor, this rank's chunk of it for an FSDP2 shard (Shard(0): torch.chunk over the mesh), so no collective."""
    replica = dict(model.named_parameters())
    for name, p in base_parameters(engine):
        whole = replica.get(name.replace(".base.", "."))
        if whole is None or tuple(whole.shape) != tuple(p.shape):
            raise EngineError(f"the sampling replica has no weight {name} of shape {tuple(p.shape)}")
        if is_sharded(p):
            dt: Any = p
            mesh = dt.device_mesh
            local = dt.to_local()
            expected = torch.chunk(whole.detach(), mesh.size(), dim=0)
            index = mesh.get_local_rank()
            part = expected[index] if index < len(expected) else whole.detach()[:0]
            same = tuple(local.shape) == tuple(part.shape) and torch.equal(local, part)
        else:
            same = torch.equal(p.detach(), whole.detach())
        if not same:
            raise EngineError(f"the sampling replica's {name} differs from the training model's")
