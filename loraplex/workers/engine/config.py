"""Every knob of the training engine, typed, with its default and why (the pool builds one from Settings:
pool/process.engine_spec; tests and benchmarks build their own). `build_engine` (build.py) reads it once."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.workers.engine.lm_head import LOSS_CHUNK_TOKENS
from loraplex.workers.engine.recompute import RecomputePolicy
from loraplex.workers.lora.slot_bank import DEFAULT_TARGET_MODULES, LoraOp


@dataclass(frozen=True)
class EngineConfig:
    # Adapters resident at once: the slot banks' first dimension (more live in the adapter store's host tiers).
    num_slots: int = 8
    # The banks' rank width: an adapter of a smaller rank zero-pads its slot (exact: padding gets zero gradient).
    max_rank: int = 16
    # Leaf names of the nn.Linear layers (or fused experts' projections) that get slot banks, in the pool's order.
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    # Tokens per microbatch (real tokens when packed, count x longest when padded): gradients accumulate across them.
    microbatch_tokens: int = 4096
    # Rows per chunk of the LM head's log-softmax: never fp32 logits for the whole microbatch (DESIGN.md choice 6).
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
    # The per-layer op of the unfused path; None: `select_lora_op`'s choice for the device and dtype (grouped_mm
    # where it is faster). Given, it also turns the fused path off unless `fused_lora` says otherwise.
    lora_op: LoraOp | None = None
    # Gather and cast the microbatch's slots once, one autograd node per LoRA layer (lora/fused.py); None: on unless
    # `lora_op` is given. Flippable between calls (Engine.fused_lora; on every rank alike).
    fused_lora: bool | None = None
    # When a microbatch's decoder layers keep only their inputs and run again in the backward (recompute.py): by
    # default above 16,384 tokens, where activations would not fit.
    recompute: RecomputePolicy = field(default_factory=RecomputePolicy)
    # Packed microbatches ([1, N] of real tokens, no padding); False: [B, T_max] padded rows. Same results; flippable.
    packed: bool = True
    # RMSNorms and the MLP's activation as Triton kernels in training microbatches (kernels/fused_elementwise.py);
    # None: where triton and CUDA are (measured faster on the H200); False: not installed. Flippable where installed.
    fused_elementwise: bool | None = None
    # Training microbatches' decoder body replayed as CUDA graphs (body_graphs.py): host time is what small steps are
    # bound by. None: on where they apply (one CUDA rank or replicated base, fused grouped LoRA, no expert banks).
    cuda_graphs: bool | None = None
    # The LM head's log-softmax as Triton kernels (kernels/triton_lm_head.py): no fp32 [chunk, V]; CUDA only.
    fused_head: bool = True
    # With a process group: the base weights sharded per decoder layer with FSDP2 (True) or a whole copy per rank
    # (False: plain data parallelism for a base that fits one device; no collectives in the forward).
    shard_base: bool = True
    # On the fused path, the LoRA layers that read one input (q/k/v, gate/up) run as one node sharing their A product
    # (lora/siblings.py); None: on (2.7-5.5% faster one-adapter steps on the H200). Flippable.
    shared_lora_inputs: bool | None = None

    def __post_init__(self) -> None:
        # One order, no repeats, and a tuple whatever iterable was given (the config is hashed and pickled).
        object.__setattr__(self, "target_modules", tuple(dict.fromkeys(self.target_modules)))
