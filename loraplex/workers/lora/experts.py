"""LoRA on the experts of a mixture-of-experts block: per-slot expert banks, mixed adapters and experts.

The base experts are transformers' fused 3-D parameters (Qwen3-MoE: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I];
frozen), selected per token by the block's frozen router (top-k experts `idx` [N, K] with weights `w` [N, K]). Each
adapter slot s has, for every expert e, a LoRA pair on the expert's gate, up and down projections:

    gate_a [S, E, H, r_max]  gate_b [S, E, r_max, I]     up_a / up_b: the same     down_a [S, E, I, r_max]  down_b [S, E, r_max, H]

Semantics (plain torch, `experts_reference`): the adapter adapts the expert's weights, W_e -> W_e + c_g (A_e B_e)^T, and
the block combines the adapted experts as it combines the base ones. For token n of adapter group g (slot s_g, rank
r_g, scale c_g = alpha_g / r_g) and each of its k slots (e = idx[n, k]):

    gate = x_n W_gate_e^T + c_g (x_n A_gate[s_g, e][:, :r_g]) B_gate[s_g, e][:r_g]        (up the same)
    h    = act(gate) * up
    out  = h W_down_e^T + c_g (h A_down[s_g, e][:, :r_g]) B_down[s_g, e][:r_g]
    y_n += w[n, k] * out

So the expert LoRA is scaled by the routing weight, as the base expert's output is (our documented choice: it is what
merging the adapter into the expert weights computes, so an exported adapter merged into the base model gives the
same outputs). With zero LoRA this is transformers' own `Qwen3MoeExperts.forward` (tests/unit/workers/test_lora_experts.py).

Fast path (`experts_grouped`): the N*K (token, slot) pairs sorted by (expert, adapter group); the base projections as
one `grouped_mm` over experts, the LoRA products as `grouped_mm`s over the E*G (expert, group) groups with the
groups' A/B stacked (`grouped.GroupedLoraDelta`, the dense op's hand-written backward), the routing weights applied
per pair and the pairs added back to their tokens (index_add_). No host sync: where E*G exceeds grouped_mm's
group-count limit (`max_groups`) the LoRA products run in chunks of groups over all the pairs, the pairs outside a
chunk at row scale 0 (`_lora_pairs`), so a CUDA graph captures any group count. Rank padding is exact as in
grouped.py (the padding is zero).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.runtime.thread_switch import ThreadSwitch
from loraplex.workers.lora.gemm import dense, grouped_mm
from loraplex.workers.lora.grouped import GroupedLoraDelta
from loraplex.workers.lora.routing import Routing

# grouped_mm's group count above which the LoRA products run in chunks of groups (one peer measured 1,023 as the
# limit of the CUDA kernel; the CPU one has none, tests lower it to check the chunks).
MAX_GROUPS = 1023
Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertBanks:
    """One MoE block's expert LoRA banks (fp32 masters; see the module doc for shapes). A projection without LoRA
    (the pool does not target it) has None for both."""

    gate_a: torch.Tensor | None
    gate_b: torch.Tensor | None
    up_a: torch.Tensor | None
    up_b: torch.Tensor | None
    down_a: torch.Tensor | None
    down_b: torch.Tensor | None

    def pairs(self) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...]:
        return (self.gate_a, self.gate_b), (self.up_a, self.up_b), (self.down_a, self.down_b)


def _check(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, routing: Routing) -> None:
    if x.dim() != 2 or idx.shape != weights.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(f"x [N, H] with top-k index / weights [N, K], got {tuple(x.shape)}, {tuple(idx.shape)}")
    if routing.num_rows != x.shape[0]:
        raise ValueError(f"routing covers {routing.num_rows} rows but the block sees {x.shape[0]}")
    if gate_up.dim() != 3 or gate_up.shape[2] != x.shape[1]:
        raise ValueError(f"gate_up_proj must be [E, 2I, {x.shape[1]}], got {tuple(gate_up.shape)}")


def _plus_lora(
    base: torch.Tensor, t: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, scale: float
) -> torch.Tensor:
    if a is None or b is None:
        return base
    return base + ((t @ a.to(t.dtype)) * scale) @ b.to(t.dtype)


def experts_reference(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    banks: ExpertBanks,
    routing: Routing,
    act: Activation,
) -> torch.Tensor:
    """The module doc's semantics as a loop over adapter groups and experts (the oracle every fast path equals)."""
    _check(x, idx, weights, gate_up, routing)
    y = torch.zeros_like(x)
    for start, end, slot, rank, scale in zip(
        routing.starts, routing.ends, routing.slots, routing.ranks, routing.scales, strict=True
    ):
        for e in range(gate_up.shape[0]):
            tokens, k = torch.where(idx[start:end] == e)
            if tokens.numel() == 0:
                continue
            (ga, gb), (ua, ub), (da, db) = (
                (None, None) if a is None or b is None else (a[slot, e, :, :rank], b[slot, e, :rank])
                for a, b in banks.pairs()
            )  # fmt: skip
            xe = x[start:end][tokens]
            gate, up = torch.nn.functional.linear(xe, gate_up[e]).chunk(2, dim=-1)
            gate = _plus_lora(gate, xe, ga, gb, scale)
            up = _plus_lora(up, xe, ua, ub, scale)
            h = act(gate) * up
            out = _plus_lora(torch.nn.functional.linear(h, down[e]), h, da, db, scale)
            out = out * weights[start:end][tokens, k, None]
            y = y.index_add(0, tokens + start, out.to(y.dtype))
    return y


def _counts(values: torch.Tensor, bins: int) -> torch.Tensor:
    """How often each of 0..bins-1 occurs in `values` (bincount's, without its device-to-host read of the maximum)."""
    return torch.zeros(bins, dtype=torch.int64, device=values.device).index_add_(0, values, torch.ones_like(values))


def _stack(bank: torch.Tensor, slot_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bank [S, E, d1, d2] -> the (expert, group) stack [E*G, d1, d2] of the groups' slots, in the pairs' order."""
    stack = bank.index_select(0, slot_ids).transpose(0, 1)  # [E, G, d1, d2]
    return stack.reshape(-1, *stack.shape[2:]).to(dtype)


def _stacked(
    a_bank: torch.Tensor, b_bank: torch.Tensor, slot_ids: torch.Tensor, dtype: torch.dtype, trigger: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The A and B stacks ([E*G, in, r] / [E*G, r, out]). With the microbatch's `trigger`, through `_BankStack` (the
    gradients go straight into the masters' .grad); else through autograd."""
    if trigger is not None:
        return _BankStack.apply(trigger, a_bank, slot_ids, dtype), _BankStack.apply(trigger, b_bank, slot_ids, dtype)
    return _stack(a_bank, slot_ids, dtype), _stack(b_bank, slot_ids, dtype)


_discarding = ThreadSwitch()


def bank_gradients_discarded() -> AbstractContextManager[None]:
    """Within it, expert banks read for training (`_BankStack`) run their backward's kernels but add nothing to the
    masters' .grad. A CUDA graph's warm-up (workers/engine/body_graphs.py) runs the body on placeholder inputs whose
    gradients are no adapter's: added, they would join the adapter in the placeholder's slot (and a placeholder's
    non-finite activations, times its zero gradient, are NaN)."""
    return _discarding.set()


class _BankStack(torch.autograd.Function):
    """An fp32 master bank [S, E, d1, d2] -> its groups' (expert, group) stack [E*G, d1, d2] in the compute dtype, whose
    backward adds the stack's gradient into `bank.grad` in place (index_add_ over the slots) instead of handing autograd
    a bank-sized gradient. The gradient then reaches the optimizer when the backward is asked for the microbatch's
    `trigger` only, as a CUDA graph's captured backward is (workers/engine/body_graphs.py); `trigger` is an input so
    that this node is on that path. Slots may repeat (a graph's pad groups): their rows add up."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, bank: torch.Tensor, slot_ids: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        if bank.grad is None:
            raise ValueError("an expert bank read for training needs its .grad buffer (the optimizer's flat view)")
        ctx.bank, ctx.slot_ids, ctx.discard = bank, slot_ids, _discarding.on
        return _stack(bank, slot_ids, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        bank: torch.Tensor = ctx.bank
        experts, groups = bank.shape[1], ctx.slot_ids.shape[0]
        per_group = grad.reshape(experts, groups, *grad.shape[1:]).transpose(0, 1).to(torch.float32)
        assert bank.grad is not None
        if ctx.discard:  # the same kernel, into one slot's scratch
            scratch = bank.grad.new_zeros(1, *bank.grad.shape[1:])
            scratch.index_add_(0, torch.zeros_like(ctx.slot_ids), per_group)
        else:
            bank.grad.index_add_(0, ctx.slot_ids, per_group)
        return None, None, None, None


def _lora_pairs(
    t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_scales: torch.Tensor, offs_eg: torch.Tensor, max_groups: int
) -> torch.Tensor:
    """The LoRA delta of the sorted pairs t [P, in] over the (expert, group) groups. Beyond grouped_mm's `max_groups`,
    in chunks of consecutive groups, each over all P rows: a chunk's first group also takes the rows before it and its
    last the rows after it, at row scale 0 (so they add exact zeros to the delta and to every gradient), and the
    chunks' deltas add up. The chunks' row ranges stay on the device: no host read, so a CUDA graph captures it."""
    t = dense(t)
    count = a.shape[0]
    if count <= max_groups:
        return GroupedLoraDelta.apply(t, a, b, row_scales, offs_eg)
    rows = torch.arange(t.shape[0], device=t.device, dtype=offs_eg.dtype).view(-1, 1)
    everything = torch.full((1,), t.shape[0], device=t.device, dtype=offs_eg.dtype)
    delta: torch.Tensor | None = None
    for g0 in range(0, count, max_groups):
        g1 = min(count, g0 + max_groups)
        first = offs_eg[g0 - 1] if g0 else offs_eg.new_zeros(())
        inside = (rows >= first) & (rows < offs_eg[g1 - 1])
        offs = torch.cat([offs_eg[g0 : g1 - 1], everything])
        piece = GroupedLoraDelta.apply(t, a[g0:g1], b[g0:g1], row_scales * inside, offs)
        delta = piece if delta is None else delta + piece
    assert delta is not None
    return delta


def experts_grouped(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    banks: ExpertBanks,
    routing: Routing,
    act: Activation,
    max_groups: int = MAX_GROUPS,
    trigger: torch.Tensor | None = None,
) -> torch.Tensor:
    """`experts_reference`'s semantics through grouped GEMMs (module doc). x [N, H] in the compute dtype. It reads the
    routing's device tensors only (offs, row_scales, slot_ids), so a CUDA graph replays it with another microbatch's
    routing copied into them. `trigger`: the banks' gradients go into their .grad in place (`_BankStack`)."""
    _check(x, idx, weights, gate_up, routing)
    n, k = idx.shape
    experts, groups = gate_up.shape[0], routing.num_groups
    pair_token = torch.arange(n, device=x.device).repeat_interleave(k)
    pair_expert = idx.reshape(-1)
    # each row's group from the groups' row ends, on the device
    row_groups = torch.searchsorted(routing.offs, torch.arange(n, device=x.device, dtype=routing.offs.dtype), right=True)
    key = pair_expert * groups + row_groups[pair_token]
    order = torch.argsort(key, stable=True)
    tokens = pair_token[order]
    offs_e = _counts(pair_expert, experts).cumsum(0).to(torch.int32)
    offs_eg = _counts(key, experts * groups).cumsum(0).to(torch.int32)
    row_scales = routing.row_scales.index_select(0, tokens)
    xs = x.index_select(0, tokens)

    def plus_lora(
        base: torch.Tensor, t: torch.Tensor, a_bank: torch.Tensor | None, b_bank: torch.Tensor | None
    ) -> torch.Tensor:
        if a_bank is None or b_bank is None:
            return base
        a, b = _stacked(a_bank, b_bank, routing.slot_ids, t.dtype, trigger)
        return base + _lora_pairs(t, a, b, row_scales, offs_eg, max_groups)

    gate, up = grouped_mm(dense(xs), gate_up.transpose(1, 2), offs=offs_e).chunk(2, dim=-1)
    gate = plus_lora(gate, xs, banks.gate_a, banks.gate_b)
    up = plus_lora(up, xs, banks.up_a, banks.up_b)
    h = act(gate) * up
    out = plus_lora(grouped_mm(dense(h), down.transpose(1, 2), offs=offs_e), h, banks.down_a, banks.down_b)
    out = out * weights.reshape(-1)[order].view(-1, 1)
    return torch.zeros_like(x).index_add(0, tokens, out.to(x.dtype))
