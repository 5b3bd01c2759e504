"""The training engine of one worker: a frozen base model with slot banks, adapters in slots, mixed-batch
forward/backward with gradient accumulation, and batched AdamW.

LoRA path (DESIGN.md choices 1-3): by default the fused one (lora/fused.py): per microbatch the groups' slots are gathered
from the optimizer's flat master buffer and cast once, every LoRA layer is one autograd node reading views of that, and
the microbatch's gradients are folded into the optimizer's flat gradient with one index_add_. `fused_lora=False` (the
config's default when it names a `lora_op`) runs the op per layer on the master banks through autograd instead.

Layout: by default a microbatch is packed, its sequences (all adapters', adapter-contiguous) concatenated
into one [1, N] row of real tokens, no padding (`batching.packed_layout`: RoPE positions restart per sequence, cu_seqlens
for the packed attention, workers/kernels/packed_attention.py); microbatches are cut by real tokens. `packed=False` keeps the
padded layout: [B, T_max] rows padded on the right, cut by count x longest. Both give the same results (to fp32
rounding on the CPU: tests/unit/workers/test_engine_packed.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, cast

import torch

from loraplex.errors import CapacityError, ConflictError, EngineError, InvalidRequestError, LoraplexError, NotFoundError
from loraplex.protocol.payloads import DatumPayload
from loraplex.workers.engine.batching import (
    PreparedItem,
    SeqRef,
    layout,
    packed_layout,
    prepare_item,
    split_microbatches,
)
from loraplex.workers.engine.body_graphs import BodyGraph, PaddedMicrobatch, pad_microbatch
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.lm_head import target_logprobs
from loraplex.workers.engine.losses import segments_of
from loraplex.workers.engine.optimizer import AdamParams
from loraplex.workers.engine.parts import EngineParts
from loraplex.workers.engine.recompute import recomputing
from loraplex.workers.lora import MicrobatchBanks, Routing, base_parameters, check_only_lora_trainable
from loraplex.workers.lora.init import init_lora_a
from loraplex.workers.lora.routing import to_device
from loraplex.workers.ranks.distributed import all_gather_varlen, all_reduce_slot_grads, split_rows
from loraplex.workers.state.slot_rows import SlotRows


@dataclass(frozen=True)
class AdapterRecord:
    model_id: str
    slot: int
    rank: int
    alpha: float
    seed: int
    # The leaf names (q_proj, ...) this adapter trains, in the pool's order; None: all of the pool's target modules.
    # The others keep A and B at exactly zero (zero A and B get zero gradients; the optimizer never moves them).
    target_modules: tuple[str, ...] | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _fill_logprobs(logprobs: list[list[list[float]]], outputs: Sequence[tuple[Sequence[SeqRef], torch.Tensor]]) -> None:
    """Every microbatch's target logprobs into the per-datum lists, in one device-to-host copy (one sync per step)."""
    if not outputs:
        return
    seqs = [s for mb, _ in outputs for s in mb]
    values = torch.cat([lp for _, lp in outputs]).cpu().split([s.length for s in seqs])
    for seq, v in zip(seqs, values, strict=True):
        logprobs[seq.item][seq.datum] = v.tolist()


class Engine(SlotRows):
    """One worker's training engine over the parts `build_engine` (build.py) made from an EngineConfig. Construct it
    with `build_engine(model, config, device, group)`. The switches `packed`, `fused_lora`, `fused_elementwise`,
    `cuda_graphs`, `fused_head`, `shared_lora_inputs`, `recompute` and `microbatch_tokens` start as the config says
    and may be flipped between calls (with several ranks, on every rank alike)."""

    def __init__(self, parts: EngineParts, config: EngineConfig) -> None:
        self.config = config
        self.model = parts.model
        self.device = parts.device
        self.compute_dtype = parts.compute_dtype
        self.context = parts.context
        self.banks = parts.banks
        self.dense_width = parts.dense_width
        self.optimizer = parts.optimizer
        self.sibling_groups = parts.sibling_groups
        self.body, self.head, self.trunk = parts.body, parts.head, parts.trunk
        self.vocab_size, self.pad_id = parts.vocab_size, parts.pad_id
        self.graphs = parts.graphs
        self._staging = parts.staging
        self._elementwise_switch = parts.elementwise
        self._fused_grouped = parts.fused_grouped
        self.dist = parts.group  # None: one process, no process group (a group of one still shards, trivially)
        self.shard_base = parts.shard_base
        self.num_slots = config.num_slots
        self.max_rank = config.max_rank
        self.target_modules = config.target_modules
        self.loss_chunk_tokens = config.loss_chunk_tokens
        self.microbatch_tokens = config.microbatch_tokens
        self.packed = bool(config.packed)
        self.fused_lora = parts.fused_lora
        self.cuda_graphs = parts.cuda_graphs
        self.fused_head = config.fused_head
        self.recompute = config.recompute
        self._adapters: dict[str, AdapterRecord] = {}
        self._free = list(range(config.num_slots))
        self._uniform_shapes_seen: set[tuple[int, int]] = set()
        # Each step reads these parameters' requires_grad flags; walking the module tree by name instead costs ~2 ms a
        # step at 36 layers, before the step's first kernel. Listed after the base is sharded: the parameters it keeps.
        self._base_parameters = base_parameters(self.model)

    @property
    def fused_modules(self) -> int:
        """The modules the fused norm / activation kernels were installed on (0: none)."""
        return self._elementwise_switch.installed

    @property
    def fused_elementwise(self) -> bool:
        """Training microbatches use the fused norm / activation kernels (where installed)."""
        return self._elementwise_switch.on

    @fused_elementwise.setter
    def fused_elementwise(self, on: bool) -> None:
        self._elementwise_switch.on = bool(on)

    def summary(self) -> str:
        """One line for the pool's start log: device, dtype, capacity and the memory the rank holds now."""
        base = sum(p.numel() for p in self.model.parameters() if not p.requires_grad)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            memory = f"{torch.cuda.memory_allocated(self.device) / 2**30:.1f} of {total / 2**30:.0f} GiB on the GPU"
        else:
            import resource  # max RSS in KiB on Linux

            memory = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB peak host memory"
        return (
            f"device {self.device}, dtype {str(self.compute_dtype).removeprefix('torch.')}, {base / 1e9:.2f} B base "
            f"parameters, {self.num_slots} slots, max rank {self.max_rank}, LoRA state (fp32) "
            f"{4 * self.optimizer.data.numel() * 4 / 2**30:.2f} GiB, {memory}"
        )

    # ---- adapters ----------------------------------------------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, AdapterRecord]:
        return dict(self._adapters)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def adapter(self, model_id: str) -> AdapterRecord:
        try:
            return self._adapters[model_id]
        except KeyError:
            raise NotFoundError(f"adapter {model_id!r} is not resident on this worker") from None

    def create_adapter(
        self, model_id: str, rank: int, alpha: float, seed: int, target_modules: Iterable[str] | None = None
    ) -> AdapterRecord:
        """Put a new adapter in a free slot: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform a=sqrt(5), as PEFT) hashed
        from `seed` on the device (lora/init.py: same weights in any slot, on any device), B = 0, gradients and Adam
        state zero. target_modules: a non-empty subset of the pool's (leaf names; None = all): the other modules' A is
        zeroed after the init (their B is zero already), so they stay exactly zero and the trained modules' init is the
        one a full adapter of that seed gets."""
        if model_id in self._adapters:
            raise ConflictError(f"adapter {model_id!r} already exists")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.max_rank:
            raise InvalidRequestError(
                f"rank must be an integer in [1, {self.max_rank}] (this pool's max), got {rank!r}"
            )
        if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
            raise InvalidRequestError(f"alpha must be a positive number, got {alpha!r}")
        targets = self.resolve_target_modules(target_modules)  # checked before a slot is claimed
        record = self.claim_slot(model_id, rank, alpha, seed, targets)
        init_lora_a(list(self.banks.values()), record.slot, rank, int(seed))
        if targets is not None:
            with torch.no_grad():
                for name, bank in self.banks.items():
                    if name not in self.adapter_modules(record):
                        bank.lora_A[record.slot].zero_()
        return record

    def resolve_target_modules(self, target_modules: Iterable[str] | None) -> tuple[str, ...] | None:
        """An adapter's target modules, checked: None for all of the pool's (also when the set is the pool's), else the
        subset in the pool's order. InvalidRequestError for an empty set or a module the pool has no bank for."""
        if target_modules is None:
            return None
        if isinstance(target_modules, str):
            raise InvalidRequestError(f"target_modules must be a list of module names, got {target_modules!r}")
        wanted = set(target_modules)
        if not wanted:
            raise InvalidRequestError("target_modules is empty: an adapter trains at least one module")
        unknown = sorted(m for m in wanted if m not in self.target_modules)
        if unknown:
            raise InvalidRequestError(
                f"target_modules {unknown} are not among this pool's LoRA modules {list(self.target_modules)}"
            )
        if wanted == set(self.target_modules):
            return None
        return tuple(m for m in self.target_modules if m in wanted)

    def adapter_target_modules(self, record: AdapterRecord) -> tuple[str, ...]:
        """The leaf names the adapter trains, in the pool's order."""
        return record.target_modules if record.target_modules is not None else self.target_modules

    def adapter_modules(self, record: AdapterRecord) -> list[str]:
        """The bank (full module) names the adapter trains, in bank order."""
        if record.target_modules is None:
            return list(self.banks)
        leaves = set(record.target_modules)
        return [name for name in self.banks if name.rsplit(".", 1)[-1] in leaves]

    def _trained_params(self, record: AdapterRecord) -> frozenset[int] | None:
        """Indices into optimizer.params (A, B per bank, in bank order) the adapter trains; None: all of them."""
        if record.target_modules is None:
            return None
        mine = set(self.adapter_modules(record))
        return frozenset(j for i, name in enumerate(self.banks) if name in mine for j in (2 * i, 2 * i + 1))

    def claim_slot(
        self, model_id: str, rank: int, alpha: float, seed: int, target_modules: Iterable[str] | None = None
    ) -> AdapterRecord:
        """Register an adapter in a free, zeroed slot (weights, gradients, Adam state all zero); the caller fills it
        (only the modules in `target_modules`, None = all: the others must stay zero)."""
        if model_id in self._adapters:
            raise ConflictError(f"adapter {model_id!r} already exists")
        targets = self.resolve_target_modules(target_modules)
        if not self._free:
            raise CapacityError(f"all {self.num_slots} adapter slots are in use")
        record = AdapterRecord(model_id, self._free.pop(0), int(rank), float(alpha), int(seed), targets)
        self._clear_slot(record.slot)
        self._adapters[model_id] = record
        return record

    def reset_adapter(
        self, model_id: str, rank: int, alpha: float, seed: int, target_modules: Iterable[str] | None = None
    ) -> AdapterRecord:
        """Keep the adapter's slot but zero everything in it and give it new hyperparameters and target modules (a
        checkpoint load)."""
        old = self.adapter(model_id)
        targets = self.resolve_target_modules(target_modules)
        self._clear_slot(old.slot)
        record = AdapterRecord(model_id, old.slot, int(rank), float(alpha), int(seed), targets)
        self._adapters[model_id] = record
        return record

    def is_resident(self, model_id: str) -> bool:
        return model_id in self._adapters

    def delete_adapter(self, model_id: str) -> None:
        record = self.adapter(model_id)
        self._clear_slot(record.slot)
        del self._adapters[model_id]
        self._free.append(record.slot)
        self._free.sort()

    def _clear_slot(self, slot: int) -> None:
        """Zero the slot's weights, gradients and Adam state: four row fills on the flat buffers, not one per bank."""
        self.optimizer.adopt_views()
        with torch.no_grad():
            self.optimizer.data[slot].zero_()
            self.optimizer.grad[slot].zero_()
        self.optimizer.reset_slots([slot])

    def adapter_weights(self, model_id: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per module the adapter trains: (A [in, r], B [r, out]) real-rank parts, fp32 CPU copies."""
        r = self.adapter(model_id)
        return {
            name: (
                self.banks[name].lora_A[r.slot, ..., : r.rank].detach().cpu().clone(),
                self.banks[name].lora_B[r.slot, ..., : r.rank, :].detach().cpu().clone(),
            )
            for name in self.adapter_modules(r)
        }

    def adapter_grads(self, model_id: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Accumulated, not yet applied gradients, shaped as adapter_weights (zeros when none)."""
        r = self.adapter(model_id)
        out = {}
        for name in self.adapter_modules(r):
            b = self.banks[name]
            ga, gb = (
                (p.grad[r.slot] if p.grad is not None else torch.zeros_like(p[r.slot])) for p in (b.lora_A, b.lora_B)
            )
            out[name] = (ga[..., : r.rank].detach().cpu().clone(), gb[..., : r.rank, :].detach().cpu().clone())
        return out

    def load_adapter_weights(self, model_id: str, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Overwrite an adapter's weights (restore, tests); every module it trains must be given (and no other), shaped as
        adapter_weights."""
        r = self.adapter(model_id)
        modules = self.adapter_modules(r)
        if set(weights) != set(modules):
            raise InvalidRequestError(f"weights must cover exactly the adapter's modules {modules[:3]}...")
        with torch.no_grad():
            for name in modules:
                bank = self.banks[name]
                a, b = weights[name]
                lead = tuple(bank.lora_A.shape[1:-2])  # () dense, (E,) an MoE's experts
                want_a, want_b = (*lead, bank.in_features, r.rank), (*lead, r.rank, bank.out_features)
                if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                    raise InvalidRequestError(f"{name}: expected A {want_a}, B {want_b}")
                bank.lora_A[r.slot].zero_()
                bank.lora_B[r.slot].zero_()
                bank.lora_A[r.slot, ..., : r.rank] = a.to(self.device, torch.float32)
                bank.lora_B[r.slot, ..., : r.rank, :] = b.to(self.device, torch.float32)

    # ---- forward / backward ------------------------------------------------------------------------------------------
    def prepare(
        self,
        model_id: str,
        data: Sequence[DatumPayload],
        loss_fn: str,
        loss_fn_config: Mapping[str, Any] | None = None,
        forward_only: bool = False,
    ) -> PreparedItem:
        """Validate one request's datums, as the payload decoder built them, against this engine (adapter resident, ids
        in vocab, lengths, loss)."""
        self.adapter(model_id)
        return prepare_item(model_id, data, loss_fn, loss_fn_config, forward_only, self.vocab_size)

    def forward_backward(self, prepared: Sequence[PreparedItem]) -> list[dict[str, Any]]:
        """Run every item (from `prepare`, which validates it) in one mixed batch (adapter-contiguous rows, token-capped
        microbatches, gradients accumulated into each trainable item's slot)."""
        if any(p.requires_grad for p in self._base_parameters):
            check_only_lora_trainable(self.model)  # raises, naming them
        self.optimizer.adopt_views()  # the fused path reads and writes the flat buffers: the banks must be their views
        logprobs: list[list[list[float]]] = [[[] for _ in it.datums] for it in prepared]
        losses: list[torch.Tensor] = [torch.zeros((), device=self.device) for _ in prepared]
        # Rows split across ranks (one rank: all of them); every rank knows every rank's microbatches.
        world, rank = (self.dist.world_size, self.dist.rank) if self.dist is not None else (1, 0)
        per_rank = [
            split_microbatches(part, self.microbatch_tokens, self.packed)
            for part in split_rows(layout(prepared), world)
        ]
        trained = sorted({self.adapter(it.model_id).slot for it in prepared if not it.forward_only})
        earlier = self._take_grads(trained) if self.dist is not None and trained else None
        outputs: list[tuple[Sequence[SeqRef], torch.Tensor]] = []  # each microbatch's target logprobs, on the device
        for k in range(max(len(mbs) for mbs in per_rank)):
            # Backward in microbatch k on every rank iff some rank trains in it: the FSDP collectives line up.
            trainable = any(not prepared[s.item].forward_only for mbs in per_rank if k < len(mbs) for s in mbs[k])
            if k < len(per_rank[rank]):
                outputs.append(
                    (per_rank[rank][k], self._run_microbatch(prepared, per_rank[rank][k], losses, trainable))
                )
            else:
                self._run_dummy_microbatch(trainable)
        _fill_logprobs(logprobs, outputs)
        if self.dist is not None:
            if earlier is not None:
                self._reduce_grads(trained, earlier)
            losses = self._gather_outputs(per_rank, logprobs, losses)
        loss_values = torch.stack(losses).tolist() if losses else []
        return [
            {
                "loss_fn_outputs": [{"logprobs": lp} for lp in logprobs[i]],
                "metrics": {"loss:sum": loss_values[i], **prepared[i].metrics(logprobs[i])},  # name:reduction keys
            }
            for i in range(len(prepared))
        ]

    def _routing(self, items: Sequence[PreparedItem], mb: Sequence[SeqRef], row_length: int | None) -> Routing:
        """One group per run of consecutive sequences of the same adapter; computed once for every layer. A sequence
        holds `row_length` rows (padded: the microbatch's longest), or its own length (None: packed, real rows only)."""
        slots: list[int] = []
        ranks: list[int] = []
        scales: list[float] = []
        rows: list[int] = []
        seen: set[str] = set()
        previous = None
        for seq in mb:
            model_id = items[seq.item].model_id
            if model_id != previous:
                if model_id in seen:
                    # batching.layout keeps each adapter's rows contiguous; the fused path's one-op gradient fold
                    # (index_add_ over the groups' slots) relies on it.
                    raise EngineError(f"internal: adapter {model_id!r} has two row groups in one microbatch")
                seen.add(model_id)
                r = self.adapter(model_id)
                slots.append(r.slot)
                ranks.append(r.rank)
                scales.append(r.scale)
                rows.append(0)
                previous = model_id
            rows[-1] += seq.length if row_length is None else row_length
        return Routing.build(slots, ranks, scales, rows, self.device)

    def _run_microbatch(
        self,
        items: Sequence[PreparedItem],
        mb: Sequence[SeqRef],
        losses: list[torch.Tensor],
        trainable: bool | None = None,
    ) -> torch.Tensor:
        """Forward (and backward when `trainable`: by default, when a row of `mb` trains) one microbatch, packed or
        padded (`self.packed`); adds to its items' losses and returns its datums' target logprobs (fp32 [tokens], on
        the device: read back once per step, so the host queues the next microbatch while the device still runs this
        one)."""
        datums = [items[s.item].datums[s.datum] for s in mb]
        targets = to_device(torch.cat([d.targets for d in datums]), self.device)
        cu_seqlens: torch.Tensor | None = None
        max_length: int | None = None
        uniform = False
        real_rows: torch.Tensor | None = None
        if trainable is None:
            trainable = any(not items[s.item].forward_only for s in mb)
        graphed: tuple[BodyGraph, PaddedMicrobatch] | None = None
        banks: MicrobatchBanks | None
        if self.packed:
            # One row of real tokens, sequences back to back: the packed attention keeps each sequence to itself and
            # RoPE restarts per sequence, so every token sees exactly what it sees alone (or padded).
            packed = packed_layout([d.length for d in datums])
            tokens = torch.cat([d.tokens for d in datums]).view(1, -1)
            positions = packed.positions.view(1, -1)
            routing = self._routing(items, mb, None)
            graphed = self._body_graph([d.length for d in datums], routing, trainable)
            if graphed is None:
                tokens, positions, cu_seqlens = (
                    to_device(t, self.device) for t in (tokens, positions, packed.cu_seqlens)
                )
                max_length = packed.max_length
                uniform = packed.uniform and self._seen_before((packed.num_tokens // max_length, max_length))
        else:
            batch, seq_len = len(mb), max(s.length for s in mb)
            # Right padding: causal attention keeps every real token blind to the pads after it, so a datum's logprobs
            # are the same batched or alone without a padding mask; pad rows feed no loss, so their gradient is zero.
            tokens = torch.full((batch, seq_len), self.pad_id, dtype=torch.int64)
            for b, d in enumerate(datums):
                tokens[b, : d.length] = d.tokens
            real_rows = torch.cat([torch.arange(d.length) + b * seq_len for b, d in enumerate(datums)])
            tokens, real_rows = (to_device(t, self.device) for t in (tokens, real_rows))
            positions = None  # 0..seq_len-1 in every row: the body's default
            routing = self._routing(items, mb, seq_len)
        with ExitStack() as scope:  # the backward below runs inside it too: recomputed layers run again there
            scope.enter_context(torch.set_grad_enabled(trainable))
            if graphed is not None:
                lp, routing, banks = self._replay_body(*graphed, tokens.view(-1), packed.positions, targets)
            else:
                banks = self._gather_banks(routing, trainable)
                # The rows every layer runs: real tokens when packed, count x longest when padded.
                recompute = recomputing(trainable and self.recompute.wants(routing.num_rows))
                for context in (self.context.use(routing, banks), recompute, self.elementwise()):
                    scope.enter_context(context)
                lp = self.trunk(
                    tokens, positions, real_rows, targets, self.loss_chunk_tokens, cu_seqlens, max_length,
                    self.fused_head, uniform,
                )  # fmt: skip
            total: torch.Tensor | None = None
            start = 0
            for item_index, run in _runs_by_item(mb):
                item = items[item_index]
                run_datums = [item.datums[s.datum] for s in run]
                count = sum(d.length for d in run_datums)
                inputs = {
                    k: to_device(torch.cat([d.inputs[k] for d in run_datums]), self.device)
                    for k in run_datums[0].inputs
                }
                segments = segments_of([d.length for d in run_datums], self.device)  # each token's datum
                item_loss = item.loss.fn(lp[start : start + count], inputs, item.loss_config, segments).sum()
                losses[item_index] = losses[item_index] + item_loss.detach()
                if not item.forward_only:
                    total = item_loss if total is None else total + item_loss
                start += count
            if total is not None:
                total.backward()
            elif trainable:  # only forward-only rows here, but other ranks train: same backward, zero gradient
                (lp.sum() * 0.0).backward()
        self._fold_grads(routing, banks)
        self._after_forward(trainable)
        return lp.detach()

    def _seen_before(self, shape: tuple[int, int]) -> bool:
        """Whether an eager microbatch of S sequences of length L ran before: it takes the attention's dense path from
        its second time on, as a graph bucket is captured on its second sighting. SDPA's dense kernel on Hopper
        (cuDNN) builds an execution plan for each new (S, L), ~150 ms on an H100 against ~0.5 ms a layer's use; a
        one-off length keeps flash varlen, which builds nothing."""
        if shape in self._uniform_shapes_seen:
            return True
        self._uniform_shapes_seen.add(shape)
        return False

    def _replay_body(
        self, graph: BodyGraph, padded: PaddedMicrobatch, tokens: torch.Tensor, positions: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, Routing, MicrobatchBanks]:  # fmt: skip
        """A packed microbatch's body replayed as CUDA graphs (workers/engine/body_graphs.py): its tokens and positions (host
        int64 [N]) go into the graph's static inputs, padded to its bucket; the LM head runs eagerly on the real rows.
        Returns the target logprobs, the padded routing and the graph's banks (their gradients fold as eager ones)."""
        pad = padded.pad_tokens
        routing = graph.load(
            torch.cat([tokens, torch.full((pad,), self.pad_id, dtype=torch.int64)]),
            torch.cat([positions, torch.arange(pad)]), padded, self._dense_columns(self.optimizer.data),
        )  # fmt: skip
        hidden = graph.run()[: routing.num_rows - pad]
        head = cast(torch.Tensor, self.head.weight)
        lp = target_logprobs(hidden, head, targets, self.loss_chunk_tokens, self.fused_head)
        return lp, routing, graph.banks

    def elementwise(self) -> AbstractContextManager[None]:
        """The fused norm / activation kernels on for the block (a training microbatch, the sampler's prefill) where
        the engine has them and wants them."""
        return self._elementwise_switch.active()

    def _body_graph(
        self, lengths: Sequence[int], routing: Routing, trainable: bool
    ) -> tuple[BodyGraph, PaddedMicrobatch] | None:
        """The CUDA graph this packed microbatch replays on (capturing its bucket when due), or None: eager. Graphs
        are for training microbatches of one rank, on the fused grouped LoRA path, without activation recomputation."""
        if self.graphs is None or not self.cuda_graphs or not trainable or not self.fused_lora:
            return None
        if self.recompute.wants(routing.num_rows):
            return None
        rows = [e - s for s, e in zip(routing.starts, routing.ends, strict=True)]
        padded = pad_microbatch(
            lengths, routing.slots, routing.ranks, routing.scales, rows, self._elementwise_on(),
            shared_inputs=self.shared_lora_inputs,
        )  # fmt: skip
        if self.recompute.wants(padded.key.tokens):
            return None
        graph = self.graphs.graph(padded)
        return None if graph is None else (graph, padded)

    @property
    def shared_lora_inputs(self) -> bool:
        """Sibling LoRA layers (q/k/v, gate/up) run as one node on the fused path (lora/siblings.py)."""
        return self.context.shared_inputs

    @shared_lora_inputs.setter
    def shared_lora_inputs(self, on: bool) -> None:
        self.context.shared_inputs = bool(on)

    def _elementwise_on(self) -> bool:
        return self._elementwise_switch.used

    # ---- several ranks (workers/ranks/distributed.py) ------------------------------------------------------------------------
    def _run_dummy_microbatch(self, trainable: bool) -> None:
        """This rank has no rows left in a microbatch other ranks run: one pad token through every layer (LoRA scale 0,
        loss x 0), with a backward when they do one, so that every FSDP all-gather happens on every rank."""
        one = torch.full((1, 1), self.pad_id, dtype=torch.int64, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Packed: one sequence of one token (cu_seqlens [0, 1]); padded: one row of one token. Either runs every layer.
        cu_seqlens = torch.tensor([0, 1], dtype=torch.int32, device=self.device) if self.packed else None
        routing = Routing.build([0], [1], [0.0], [1], self.device)
        banks = self._gather_banks(routing, trainable)
        with self.context.use(routing, banks), torch.set_grad_enabled(trainable):
            lp = self.trunk(
                one, zero.view(1, 1) if self.packed else None, None if self.packed else zero, one.view(1),
                self.loss_chunk_tokens, cu_seqlens, 1 if self.packed else None,
            )  # fmt: skip
            if trainable:
                (lp.sum() * 0.0).backward()
        self._fold_grads(routing, banks)
        self._after_forward(trainable)

    def _gather_banks(self, routing: Routing, trainable: bool) -> MicrobatchBanks | None:
        """The fused path: the microbatch's slots gathered and cast once (and an fp32 gradient buffer when it trains)."""
        if not self.fused_lora:
            return None
        return MicrobatchBanks.gather(
            self._dense_columns(self.optimizer.data), routing, self.compute_dtype, trainable=trainable,
            grouped=self._fused_grouped,
        )  # fmt: skip

    def _dense_columns(self, flat: torch.Tensor) -> torch.Tensor:
        """The dense banks' columns of a flat [S, P] buffer (all of it for a dense model): a view."""
        return flat if self.dense_width == flat.shape[1] else flat[:, : self.dense_width]

    def _fold_grads(self, routing: Routing, banks: MicrobatchBanks | None) -> None:
        """Add the microbatch's gradients into the optimizer's flat gradient (the banks' .grad views): one op. The
        routing's slots are distinct (see `_routing`), so index_add_ adds each group's row once."""
        if banks is not None and banks.grads is not None:
            self._dense_columns(self.optimizer.grad).index_add_(0, routing.slot_ids, banks.grads)

    def _after_forward(self, trainable: bool) -> None:
        if self.dist is not None and self.shard_base and not trainable:
            # FSDP2 keeps the root unit (embeddings, head) gathered after a forward for its backward; none comes.
            self.trunk.reshard()  # type: ignore[operator]

    def _take_grads(self, slots: Sequence[int]) -> list[torch.Tensor | None]:
        """Set aside the slots' accumulated gradients (global: equal on every rank) and zero them, so the coming
        backward leaves this rank's own contribution there alone."""
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        earlier: list[torch.Tensor | None] = []
        for p in self.optimizer.params:
            earlier.append(p.grad.index_select(0, idx) if p.grad is not None else None)
            if p.grad is not None:
                p.grad.index_fill_(0, idx, 0.0)
        return earlier

    def _reduce_grads(self, slots: Sequence[int], earlier: Sequence[torch.Tensor | None]) -> None:
        """grad[slots] = earlier + SUM over ranks of this step's contributions (one all-reduce for every bank)."""
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        summed = all_reduce_slot_grads(self.optimizer.params, slots)
        for p, total, before in zip(self.optimizer.params, summed, earlier, strict=True):
            if before is not None:
                total = before + total
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.index_copy_(0, idx, total)

    def _gather_outputs(
        self,
        per_rank: Sequence[Sequence[Sequence[SeqRef]]],
        logprobs: list[list[list[float]]],
        losses: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Every rank's datum logprobs and loss partial sums on every rank (one all-gather); returns the summed losses."""
        assert self.dist is not None
        seqs = [[s for mb in mbs for s in mb] for mbs in per_rank]
        tokens = [sum(s.length for s in rank_seqs) for rank_seqs in seqs]
        mine = [v for s in seqs[self.dist.rank] for v in logprobs[s.item][s.datum]]
        partial = torch.stack(losses).double().cpu() if losses else torch.zeros(0, dtype=torch.float64)
        local = torch.cat([torch.tensor(mine, dtype=torch.float64), partial]).to(self.device)
        pieces = all_gather_varlen(local, [n + len(losses) for n in tokens])
        totals = torch.zeros(len(losses), dtype=torch.float64)
        for rank_seqs, n, piece in zip(seqs, tokens, pieces, strict=True):
            piece = piece.cpu()
            for s, values in zip(rank_seqs, piece[:n].split([s.length for s in rank_seqs]), strict=True):
                logprobs[s.item][s.datum] = values.tolist()
            totals += piece[n:]
        return list(totals.unbind())

    # ---- optimizer ---------------------------------------------------------------------------------------------------
    def optim_step(
        self, items: Sequence[tuple[str, Mapping[str, Any] | AdamParams | None]]
    ) -> list[dict[str, Any] | LoraplexError]:
        """Batched AdamW over the items' adapters (apply, then clear their gradients). Per item: {"metrics": ...} or the
        error for that item alone (unknown adapter, bad hyperparameters, non-finite gradient norm: step skipped)."""
        results: list[dict[str, Any] | LoraplexError | None] = [None] * len(items)
        rounds: list[list[tuple[int, AdapterRecord, AdamParams]]] = []
        for i, (model_id, raw) in enumerate(items):
            try:
                record = self.adapter(model_id)
                hp = raw if isinstance(raw, AdamParams) else AdamParams.from_dict(raw)
            except LoraplexError as exc:
                results[i] = exc
                continue
            # The same adapter twice in one call steps twice, in order: later rounds see the cleared gradients.
            for round_ in rounds:
                if all(r.slot != record.slot for _, r, _ in round_):
                    round_.append((i, record, hp))
                    break
            else:
                rounds.append([(i, record, hp)])
        for round_ in rounds:
            stepped = self.optimizer.step(
                [r.slot for _, r, _ in round_],
                [h for _, _, h in round_],
                [r.rank for _, r, _ in round_],
                [self._trained_params(r) for _, r, _ in round_],  # a subset adapter's other modules never move
            )
            for (i, record, hp), res in zip(round_, stepped, strict=True):
                if res.stepped:
                    results[i] = {"metrics": {"grad_norm:mean": res.grad_norm, "learning_rate:mean": hp.learning_rate}}
                else:
                    results[i] = EngineError(
                        f"non-finite gradient norm ({res.grad_norm}) for adapter {record.model_id!r}: "
                        "step skipped, gradients cleared"
                    )
        return [r if r is not None else EngineError("internal: no result") for r in results]


def _runs_by_item(mb: Sequence[SeqRef]) -> list[tuple[int, list[SeqRef]]]:
    runs: list[tuple[int, list[SeqRef]]] = []
    for seq in mb:
        if runs and runs[-1][0] == seq.item:
            runs[-1][1].append(seq)
        else:
            runs.append((seq.item, [seq]))
    return runs
