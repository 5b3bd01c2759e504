"""Sibling LoRA layers: the wrapped layers of one module that read the same input (an attention block's q_proj, k_proj
and v_proj; a gated MLP's gate_proj and up_proj) run as ONE autograd node, so their A side runs once.

Semantics (plain torch): for siblings i = 0..k-1 with bank layouts L_i and base weights W_i (or none), on one x [N, in],

    outputs[i] = lora_delta_fused(x, L_i, banks, routing, base_weight=W_i)     # what each layer computes alone

and the gradients of x and of every sibling's bank views are those of the k separate calls, summed. How: the siblings'
A banks side by side, A_cat [G, in, k r] (copied once per node and microbatch; A is small), then

    forward   hs = (x @ A_cat) * scale                    one product for the k layers           [N, k r]
              out_i = hs[:, i r:(i+1) r] @ B_i             per layer (the out widths differ); + x @ W_i^T in place
    backward  dh = cat_i((dy_i @ B_i^T) * scale)           per layer, side by side                [N, k r]
              dA_cat = x^T @ dh                            one product (split into the k A gradients)
              dx = dh @ A_cat^T (+= dy_i @ W_i in place)    one product, and no sum of k [N, in] gradients by autograd
              dB_i = hs[:, i r:(i+1) r]^T @ dy_i           per layer

with the three modes of lora/fused.py: one group with the host's rank and scale (r = its rank), one group over r_max with
the scale read on the device (a CUDA graph), several groups through grouped_mm over routing.offs (r = r_max). So per
attention block x is read once instead of three times forward and backward, and 2 GEMMs instead of 6 (+ 2 adds of
[N, in]) make dA and dx; the MLP's pair the same with 2. The fp64 loop mode and shapes that grouped_mm would need padded
(in or r_max off its alignment) run the layers one by one (`SiblingGroup.output` answers None). The products are the same
in other shapes, so results agree with the layers run alone to rounding (fp32: 1e-6 in the tests), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from loraplex.workers.lora.fused import BankLayout, MicrobatchBanks, node_mode
from loraplex.workers.lora.gemm import (
    accumulate_matmul,
    alignment,
    dense,
    gmm_operand,
    grouped_mm,
    matmul_into_float,
    plus_matmul,
)
from loraplex.workers.lora.routing import Routing


class SiblingMember(Protocol):
    """What a group reads of its layers (slot_bank.SlotBankLinear is one)."""

    in_features: int
    layout: BankLayout | None
    siblings: SiblingGroup | None

    def fused_base_weight(self, x: torch.Tensor, banks: MicrobatchBanks) -> torch.Tensor | None: ...


# Leaf names of the layers one module feeds the same input (Qwen / Llama / Mistral attention and gated MLPs).
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def siblings_fusable(x: torch.Tensor, layouts: Sequence[BankLayout], banks: MicrobatchBanks, routing: Routing) -> bool:
    """Whether the one-node path covers this call: a mode other than the fp64 loop, one input width and r_max for all,
    and for grouped_mm an input width and r_max on its alignment (so the shared A product needs no padding)."""
    first = layouts[0]
    if any(lay.in_features != first.in_features or lay.max_rank != first.max_rank for lay in layouts):
        return False
    mode = node_mode(routing, banks)
    if mode == "loop":
        return False
    align = alignment(x.dtype)
    return mode != "grouped" or (first.in_features % align == 0 and first.max_rank % align == 0)


class _SiblingLora(torch.autograd.Function):
    """The k outputs of one input's sibling LoRA layers (see the module docstring); backward returns dx and accumulates
    every sibling's dA, dB into the microbatch's fp32 `grads` views."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        trigger: torch.Tensor | None,
        layouts: tuple[BankLayout, ...],
        banks: MicrobatchBanks,
        routing: Routing,
        base_weights: tuple[torch.Tensor, ...] | None,
    ) -> tuple[torch.Tensor, ...]:
        mode = node_mode(routing, banks)
        r = routing.ranks[0] if mode == "single" else layouts[0].max_rank
        weights = [banks.weights(lay) for lay in layouts]
        a_cat = torch.cat([a[:, :, :r] for a, _ in weights], dim=2).to(x.dtype)  # [G, in, k r]
        bs = [b[:, :r].to(x.dtype) for _, b in weights]  # [G, r, out_i]
        x = x if mode != "grouped" else dense(x)
        if mode == "grouped":
            hs = grouped_mm(x, a_cat, offs=routing.offs)
            hs.mul_(routing.row_scales)
        elif mode == "single_device":
            hs = x @ a_cat[0]
            hs.mul_(routing.row_scales)
        else:
            hs = (x @ a_cat[0]) * routing.scales[0]
        outputs = []
        pads = []
        for i, (b, lay) in enumerate(zip(bs, layouts, strict=True)):
            h = hs[:, i * r : (i + 1) * r]
            if mode == "grouped":
                pad_out = (-lay.out_features) % alignment(x.dtype)
                b = F.pad(b, (0, pad_out)) if pad_out else gmm_operand(b)
                delta = grouped_mm(gmm_operand(h), b, offs=routing.offs)
                delta = delta[:, : lay.out_features] if pad_out else delta
                pads.append(pad_out)
            else:
                delta = h @ b[0]
                pads.append(0)
            outputs.append(delta if base_weights is None else plus_matmul(delta, x, base_weights[i].t()))
        ctx.mode, ctx.rank, ctx.pads = mode, r, pads
        ctx.layouts, ctx.banks, ctx.routing, ctx.base_weights = layouts, banks, routing, base_weights
        ctx.save_for_backward(x, hs, a_cat, *bs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, hs, a_cat, *bs = ctx.saved_tensors
        mode, r, routing = ctx.mode, ctx.rank, ctx.routing
        layouts: tuple[BankLayout, ...] = ctx.layouts
        views = [ctx.banks.grad_views(lay) for lay in layouts]
        need_x = ctx.needs_input_grad[0]
        grouped = mode == "grouped"
        dhs = []
        for i, (gy, b, pad_out) in enumerate(zip(grad_outputs, bs, ctx.pads, strict=True)):
            if grouped:  # a zero-stride gradient (y.sum().backward()) breaks grouped_mm; pad to the aligned out width
                gy = dense(gy)
                gy, b = (F.pad(gy, (0, pad_out)), F.pad(b, (0, pad_out))) if pad_out else (gy, gmm_operand(b))
            h = hs[:, i * r : (i + 1) * r]
            gb = views[i][1] if views[i] is not None else None
            if gb is not None and grouped:
                gb[:, :r].add_(grouped_mm(gmm_operand(h.t()), gy, offs=routing.offs)[:, :, : layouts[i].out_features])
            elif gb is not None:
                accumulate_matmul(gb[0, :r], h.t(), gy)
            dhs.append(grouped_mm(gy, b.transpose(-2, -1), offs=routing.offs) if grouped else gy @ b[0].t())
        dh = torch.cat(dhs, dim=1)
        if mode == "single":
            dh = dh * routing.scales[0]
        else:
            dh.mul_(routing.row_scales)
        if any(v is not None for v in views):
            ga_cat = grouped_mm(x.t(), dh, offs=routing.offs) if grouped else matmul_into_float(x.t(), dh).unsqueeze(0)
            for i, v in enumerate(views):
                if v is not None:
                    v[0][:, :, :r].add_(ga_cat[:, :, i * r : (i + 1) * r])
        dx = None
        if need_x:
            dx = grouped_mm(dh, a_cat.transpose(-2, -1), offs=routing.offs) if grouped else dh @ a_cat[0].t()
            if ctx.base_weights is not None:
                for gy, w in zip(grad_outputs, ctx.base_weights, strict=True):
                    dx = plus_matmul(dx, gy, w)
        return dx, None, None, None, None, None


def lora_siblings_fused(
    x: torch.Tensor,
    layouts: Sequence[BankLayout],
    banks: MicrobatchBanks,
    routing: Routing,
    base_weights: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The outputs of the sibling layers `layouts` on one x [N, in] (deltas, or with `base_weights` the layers' whole
    outputs), as one node; see the module docstring. The caller checks `siblings_fusable` first."""
    if x.dim() != 2 or x.shape[1] != layouts[0].in_features or routing.num_rows != x.shape[0]:
        raise ValueError(f"x must be [{routing.num_rows}, {layouts[0].in_features}], got shape {tuple(x.shape)}")
    if base_weights is not None and len(base_weights) != len(layouts):
        raise ValueError("one base weight per sibling layer, or none")
    weights = None if base_weights is None else tuple(base_weights)
    return _SiblingLora.apply(x, banks.trigger, tuple(layouts), banks, routing, weights)


def _version(x: torch.Tensor) -> int:
    """x's in-place version counter (an inference tensor, as under torch.inference_mode, keeps none)."""
    return -1 if x.is_inference() else x._version


class SiblingGroup:
    """The wrapped layers of one module that read one input. The first of them called with an input computes every
    member's output in one node; the others' wait here until each is called with that same input (a module calls them
    one after another), so a call with any other input, or one the node does not cover, runs alone as before."""

    def __init__(self, members: Sequence[SiblingMember]) -> None:
        self.members = tuple(members)
        self._input: tuple[torch.Tensor, int, MicrobatchBanks] | None = None
        self._waiting: dict[int, torch.Tensor] = {}
        self.fused_calls = 0  # nodes run (tests and benchmarks read it)

    def output(
        self, member: SiblingMember, x: torch.Tensor, banks: MicrobatchBanks, routing: Routing
    ) -> torch.Tensor | None:
        """member's output [N, out] for its module input x [..., in]: the layer's whole output where its base matmul
        fuses into the node (`SlotBankLinear.fused_base_weight`), else its LoRA delta; None: run alone."""
        key = self._input
        if (
            key is not None
            and key[0] is x
            and key[1] == _version(x)
            and key[2] is banks
            and id(member) in self._waiting
        ):
            out = self._waiting.pop(id(member))
            if not self._waiting:
                self._input = None
            return out
        self.clear()
        layouts = [m.layout for m in self.members if m.layout is not None]
        x2 = x.reshape(-1, member.in_features)
        if len(layouts) != len(self.members) or not siblings_fusable(x2, layouts, banks, routing):
            return None
        bases = [m.fused_base_weight(x, banks) for m in self.members]
        if any(w is None for w in bases) and any(w is not None for w in bases):
            return None  # some layers fuse their base matmul and some do not (a bias): each alone
        weights = [w for w in bases if w is not None]
        outputs = lora_siblings_fused(x2, layouts, banks, routing, weights or None)
        self.fused_calls += 1
        self._waiting = {id(m): o for m, o in zip(self.members, outputs, strict=True) if m is not member}
        self._input = (x, _version(x), banks)
        return outputs[self.members.index(member)]

    def clear(self) -> None:
        self._input, self._waiting = None, {}


def install_sibling_groups(layers: Mapping[str, SiblingMember]) -> list[SiblingGroup]:
    """Group the wrapped layers `layers` (by full module name) that one module feeds the same input (SIBLING_NAMES, two
    or more of a set present under one parent, same input width) and point each member at its group."""
    by_parent: dict[tuple[str, int], list[SiblingMember]] = {}
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        for k, names in enumerate(SIBLING_NAMES):
            if leaf in names:
                by_parent.setdefault((parent, k), []).append(layer)
    groups = []
    for members in by_parent.values():
        if len(members) >= 2 and len({m.in_features for m in members}) == 1:
            group = SiblingGroup(members)
            for m in members:
                m.siblings = group
            groups.append(group)
    return groups
