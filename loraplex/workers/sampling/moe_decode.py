"""The decode step's mixture-of-experts MLP (static_decoder.py calls it for every MoE layer), with expert LoRA per row.

A Qwen3-MoE / Qwen2-MoE sparse block: the layer's own router `mlp.gate` (softmax in fp32, top-k, renormalised when
`norm_topk_prob`, cast back: what the model's forward computes) picks K experts per row with weights w [B, K]; the
fused experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], the base under `SlotBankExperts` when the pool adapts
them) run with the row's adapter on each expert's gate / up / down; a shared expert (Qwen2-MoE) is a dense gated MLP
whose LoRA is the decoder's own (`LoraPoint`s, with the row mask), gated by sigmoid(shared_expert_gate(x)).

Semantics, row b of adapter group g (scale c = alpha_g / r_g; c = 0 for a base row), each of its K experts e:

    gate = x_b W_gate_e^T + c (x_b A_gate[e, g]) B_gate[e, g]          (up the same)
    out  = (act(gate) * up) W_down_e^T + c (h A_down[e, g]) B_down[e, g]
    y_b += w[b, k] * out

which is lora/experts.py's (the training forward's) semantics: the expert LoRA is scaled by the routing weight.

Weights: `load` copies the call's adapters' expert banks (fp32 masters) once into stacks owned by the decoder, in the
compute dtype, laid out expert-major [E, G, in, r_max] (so [E * G, in, r] is a free view: one grouped GEMM group per
(expert, group)); the call samples from that frozen copy whatever trains meanwhile. Cost: per adapter group, the slot's
expert banks in the compute dtype (Qwen3-30B-A3B shape at rank 32: ~3.3 GB bf16 per group).

Two forms (`MoeDecodeMlp.batched`):
  * `moe_reference`: a loop over rows and their K experts, plain torch, for clarity (the specification).
  * `moe_batched`: every row's K (row, expert) pairs sorted once by (expert, group) (stable argsort of a static
    B * K keys); the base gate/up and down as one `grouped_mm` over experts each, the LoRA products as `grouped_mm`s
    over the E * G (expert, group) groups of the stacks; the routing weights applied per pair; the pairs put back in
    (row, k) order by an index assignment and summed over k (deterministic: no atomic adds). Every shape is fixed by
    (B, K, E, G) and the offsets stay on the device, so the step has no host sync and can be captured in a CUDA graph.
    Where E * G exceeds grouped_mm's group-count limit (`max_groups`), the LoRA runs one group at a time over the E
    experts (every pair through every adapter, its scale zeroed outside its group): more small GEMMs, still static.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.errors import EngineError
from loraplex.workers.lora.expert_bank import EXPERT_PROJECTIONS, SlotBankExperts
from loraplex.workers.lora.experts import MAX_GROUPS
from loraplex.workers.lora.gemm import dense, gmm_operand, grouped_mm

GATED_MLP = ("gate_proj", "up_proj")


class LoraPoint(Protocol):
    """static_decoder's `_LoraPoint`: the projections that read one input, with the row mask's LoRA."""

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]: ...


def is_moe_block(mlp: nn.Module) -> bool:
    """A sparse MoE block (a router `gate` and an `experts` module) rather than a dense gated MLP."""
    return hasattr(mlp, "experts") and isinstance(getattr(mlp, "gate", None), nn.Module)


def check_moe_block(mlp: nn.Module) -> None:
    """EngineError unless the block is one this module decodes: a top-k router with the Qwen MoE signature
    (x -> logits, weights, indices), fused experts, and a shared expert (if any) that is a gated MLP."""
    router, experts = mlp.gate, _base_experts(mlp)
    if not all(hasattr(router, n) for n in ("top_k", "norm_topk_prob", "weight")):
        raise EngineError("the native sampler needs a Qwen-MoE top-k router (top_k, norm_topk_prob) in MoE layers")
    if experts is None:
        raise EngineError("the native sampler needs fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I])")
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None and (
        any(getattr(shared, n, None) is None for n in (*GATED_MLP, "down_proj", "act_fn"))
        or getattr(mlp, "shared_expert_gate", None) is None
    ):
        raise EngineError("the native sampler needs an MoE block's shared expert to be a gated MLP with its gate")


def mlp_linears(mlp: Any) -> tuple[list[nn.Module], list[nn.Module]]:
    """The dense gated-MLP projections of a layer's MLP, (gate/up, down): the MLP's own, or an MoE block's shared
    expert's (none without one): the decoder gives them its LoRA points like any dense projection."""
    if is_moe_block(mlp):
        mlp = getattr(mlp, "shared_expert", None)
        if mlp is None:
            return [], []
    return [getattr(mlp, n) for n in GATED_MLP], [mlp.down_proj]


def _base_experts(mlp: nn.Module) -> Any:
    experts = mlp.experts.base if isinstance(mlp.experts, SlotBankExperts) else mlp.experts
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        return None
    return experts


def rows_of(
    mask: torch.Tensor | None, rows: int, groups: int, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's adapter group (int64 [B]; 0 for a base row) and scale (fp32 [B]; 0 for a base row), read from the
    decoder's row mask [B, G * r] (row b: its scale on its group's r columns, 0 elsewhere), on the device."""
    if mask is None or groups == 0:
        return torch.zeros(rows, dtype=torch.int64, device=device), torch.zeros(rows, device=device)
    per_group = mask.view(rows, groups, rank)[:, :, 0]  # [B, G]
    return (per_group != 0).to(torch.int8).argmax(1), per_group.sum(1)


class _Stacks:
    """One expert projection's LoRA for the decoder's G groups: a [E, G, in, r], b [E, G, r, out] (compute dtype)."""

    def __init__(self, experts: int, groups: int, shape: tuple[int, int], rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        fan_in, fan_out = shape
        self.a = torch.zeros(experts, groups, fan_in, rank, dtype=dtype, device=device)
        self.b = torch.zeros(experts, groups, rank, fan_out, dtype=dtype, device=device)


def moe_reference(
    x: torch.Tensor,
    mlp: Any,
    stacks: Sequence[_Stacks | None],
    row_group: torch.Tensor,
    row_scale: torch.Tensor,
) -> torch.Tensor:
    """The module doc's semantics for the routed experts, one row and one expert at a time (the router written out
    as Qwen's: softmax in fp32, top-k, renormalised when norm_topk_prob, cast back to the logits' dtype)."""
    router, experts = mlp.gate, _base_experts(mlp)
    logits = F.linear(x, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = top.to(logits.dtype)
    gate_s, up_s, down_s = stacks

    def plus_lora(base: torch.Tensor, t: torch.Tensor, s: _Stacks | None, e: int, g: int, c: float) -> torch.Tensor:
        return base if s is None else base + ((t @ s.a[e, g]) * c) @ s.b[e, g]

    y = torch.zeros_like(x)
    for b in range(x.shape[0]):
        g, c = int(row_group[b]), float(row_scale[b])
        for k in range(router.top_k):
            e = int(idx[b, k])
            gate, up = F.linear(x[b], experts.gate_up_proj[e]).chunk(2, dim=-1)
            gate, up = plus_lora(gate, x[b], gate_s, e, g, c), plus_lora(up, x[b], up_s, e, g, c)
            h = experts.act_fn(gate) * up
            out = plus_lora(F.linear(h, experts.down_proj[e]), h, down_s, e, g, c)
            y[b] += weights[b, k] * out
    return y


def _counts(values: torch.Tensor, bins: int) -> torch.Tensor:
    """How often each of 0..bins-1 occurs in `values` (bincount without its host read of the maximum)."""
    return torch.zeros(bins, dtype=torch.int64, device=values.device).index_add_(0, values, torch.ones_like(values))


def moe_batched(
    x: torch.Tensor,
    mlp: Any,
    stacks: Sequence[_Stacks | None],
    row_group: torch.Tensor,
    row_scale: torch.Tensor,
    max_groups: int = MAX_GROUPS,
) -> torch.Tensor:
    """`moe_reference`'s semantics through grouped GEMMs with static shapes and no host sync (module doc)."""
    experts = _base_experts(mlp)
    _, weights, idx = mlp.gate(x)  # the model's own router: [B, K] weights (x.dtype) and expert indices
    rows, k = idx.shape
    num_experts = experts.gate_up_proj.shape[0]
    groups = next((s.a.shape[1] for s in stacks if s is not None), 1)
    pair_row = torch.arange(rows, device=x.device).repeat_interleave(k)
    pair_expert = idx.reshape(-1)
    key = pair_expert * groups + row_group[pair_row]  # expert-major: sorted by key is sorted by expert too
    order = torch.argsort(key, stable=True)
    pairs = pair_row[order]
    offs_e = _counts(pair_expert, num_experts).cumsum(0).to(torch.int32)
    one_call = num_experts * groups <= max_groups
    offs_eg = _counts(key, num_experts * groups).cumsum(0).to(torch.int32) if one_call else offs_e
    pair_scale = row_scale[pairs].view(-1, 1)
    pair_group = row_group[pairs]
    xs = x.index_select(0, pairs)

    def plus_lora(base: torch.Tensor, t: torch.Tensor, s: _Stacks | None) -> torch.Tensor:
        if s is None:
            return base
        t = dense(t)
        if one_call:
            a, b = s.a.view(-1, *s.a.shape[2:]), s.b.view(-1, *s.b.shape[2:])
            h = grouped_mm(t, a, offs=offs_eg)
            h.mul_(pair_scale)  # fp32 scales, one rounding (as the training path)
            return base + grouped_mm(h, b, offs=offs_eg)
        for g in range(groups):
            h = grouped_mm(t, gmm_operand(s.a[:, g]), offs=offs_e)
            h.mul_(torch.where(pair_group.view(-1, 1) == g, pair_scale, 0.0))
            base = base + grouped_mm(h, gmm_operand(s.b[:, g]), offs=offs_e)
        return base

    gate_s, up_s, down_s = stacks
    gate, up = grouped_mm(dense(xs), experts.gate_up_proj.transpose(1, 2), offs=offs_e).chunk(2, dim=-1)
    gate, up = plus_lora(gate, xs, gate_s), plus_lora(up, xs, up_s)
    h = experts.act_fn(gate) * up
    out = plus_lora(grouped_mm(dense(h), experts.down_proj.transpose(1, 2), offs=offs_e), h, down_s)
    out = out * weights.reshape(-1)[order].view(-1, 1)
    in_place = torch.empty_like(out)
    in_place[order] = out  # back to (row, k) order: a permutation, so no two pairs write one place
    return in_place.view(rows, k, -1).sum(1).to(x.dtype)


class MoeDecodeMlp:
    """One MoE layer's MLP in the decode step: `load` the call's adapters, then `(x [B, H], mask) -> [B, H]`."""

    def __init__(
        self,
        mlp: nn.Module,
        shared_in: LoraPoint,
        shared_down: LoraPoint,
        groups: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        batched: bool = True,
        max_groups: int = MAX_GROUPS,
    ) -> None:
        check_moe_block(mlp)
        self.mlp: Any = mlp
        self.groups, self.rank = groups, rank
        self.batched, self.max_groups = batched, max_groups
        self.shared_in, self.shared_down = shared_in, shared_down
        self.has_shared = getattr(mlp, "shared_expert", None) is not None
        base = _base_experts(mlp)
        num_experts, two_inter, hidden = base.gate_up_proj.shape
        inter = two_inter // 2
        shapes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        own = mlp.experts.projection_banks() if isinstance(mlp.experts, SlotBankExperts) else {}
        self.banks = [own.get(n) for n in EXPERT_PROJECTIONS]
        self.stacks: list[_Stacks | None] = [
            _Stacks(num_experts, groups, shapes[n], rank, dtype, device) if groups and bank is not None else None
            for n, bank in zip(EXPERT_PROJECTIONS, self.banks, strict=True)
        ]

    def load(self, slots: torch.Tensor) -> None:
        """Copy the expert LoRA of these bank slots (int64 [G], group order) into the stacks (cast once)."""
        for bank, s in zip(self.banks, self.stacks, strict=True):
            if bank is None or s is None:
                continue
            a = bank.lora_A.detach().index_select(0, slots)  # [G, E, in, r]
            b = bank.lora_B.detach().index_select(0, slots)
            s.a.copy_(a.transpose(0, 1))
            s.b.copy_(b.transpose(0, 1))

    def load_group(self, group: int, slot: int) -> None:
        """Copy the expert LoRA of bank slot `slot` into group `group` of the stacks (the others unchanged)."""
        for bank, s in zip(self.banks, self.stacks, strict=True):
            if bank is None or s is None:
                continue
            s.a[:, group].copy_(bank.lora_A.detach()[slot])
            s.b[:, group].copy_(bank.lora_B.detach()[slot])

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        row_group, row_scale = rows_of(mask, x.shape[0], self.groups, self.rank, x.device)
        if self.batched:
            y = moe_batched(x, self.mlp, self.stacks, row_group, row_scale, self.max_groups)
        else:
            y = moe_reference(x, self.mlp, self.stacks, row_group, row_scale)
        if self.has_shared:
            gate, up = self.shared_in(x, mask)
            (down,) = self.shared_down(self.mlp.shared_expert.act_fn(gate) * up, mask)
            y = y + F.sigmoid(self.mlp.shared_expert_gate(x)) * down
        return y
