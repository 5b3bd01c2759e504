"""The engine's LoRA path: route and cast the banks ONCE per microbatch, then one autograd Function per LoRA layer.

Per microbatch (`MicrobatchBanks.gather`, called by the engine before the forward):

    compute = optimizer.data.index_select(0, routing.slot_ids).to(compute_dtype)   # [G, P]: the groups' slots, cast once
    grads   = zeros(G, P, fp32)                                                     # only when the microbatch trains
    ... forward + backward: every layer reads its A_g [G, in, r_max] / B_g [G, r_max, out] as VIEWS of `compute` and
        add_s its dA_g / dB_g into the matching views of `grads` ...
    optimizer.grad.index_add_(0, routing.slot_ids, grads)                           # one fold per microbatch (engine)

(P = every bank's per-slot size: the optimizer keeps all banks in one flat [S, P] buffer, `BankLayout` says where one
layer's A and B sit in it.) So per layer and microbatch the graph holds one node (`_FusedLoraDelta`) instead of the
slice / cast / mm / mul chain of `lora_delta_reference`, and its backward never materialises a bank-sized gradient.

Semantics: exactly `lora_delta_reference`'s (per group g: delta[rows_g] = ((x_g @ A[s_g][:, :r_g]) * c_g) @ B[s_g][:r_g]),
computed three ways with the same maths:
  * one group: plain matmuls on the real-rank slices (as `lora_delta_single`); with `single=False` (a CUDA graph)
    plain matmuls over r_max with the scale read from routing.row_scales on the device;
  * several groups, `grouped=True` (where `select_lora_op` picks `lora_delta_grouped`): two `F.grouped_mm` over
    routing.offs with routing.row_scales, padded for alignment as in grouped.py (exact: the rank padding is zero);
  * several groups otherwise (fp64, GPUs without a fused grouped_mm): the reference's loop over groups.
Gradients: dA_g = x_g^T @ ((dY_g @ B_g^T) * c_g) and dB_g = ((x_g @ A_g) * c_g)^T @ dY_g, computed in the compute dtype
(as the reference's matmuls) and accumulated in fp32. With `base_weight` W (the frozen base layer's, CUDA) the node
returns the whole layer's output x @ W^T + delta: the base matmul runs in place on the delta (beta = 1: no copy and no
separate add over [N, out]) and, in the backward, on the LoRA's dx (one [N, in] gradient leaves the layer, not two
that autograd then adds; bench_lora_layer.py measures it). The output requires grad even when x does not (the first layers
read a frozen embedding): the microbatch's `trigger`, a 0-dim leaf requiring grad, is an input of every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loraplex.workers.lora.gemm import accumulate_matmul, alignment, dense, gmm_operand, grouped_mm, plus_matmul
from loraplex.workers.lora.routing import Routing


@dataclass(frozen=True)
class BankLayout:
    """Where one layer's banks sit in a slot's row of the optimizer's flat [S, P] buffer: A [in, r_max] row-major from
    column a_start, B [r_max, out] row-major from column b_start."""

    a_start: int
    b_start: int
    in_features: int
    out_features: int
    max_rank: int


class MicrobatchBanks:
    """One microbatch's slots, gathered and cast once: `compute` [G, P] in the activations' dtype (no autograd), `grads`
    [G, P] fp32 (None when the microbatch does not train) and the `trigger` leaf that makes every LoRA output require
    grad. `grouped`: several groups run through grouped_mm (else the reference's loop). `single`: one group runs plain
    matmuls with its rank and scale as host numbers (False: over r_max with the scale read on the device, for a CUDA
    graph that replays with other adapters: workers/engine/body_graphs.py)."""

    def __init__(self, compute: torch.Tensor, grads: torch.Tensor | None, grouped: bool, single: bool = True) -> None:
        self.compute = compute
        self.grads = grads
        self.grouped = grouped
        self.single = single
        self.trigger = (
            torch.zeros((), device=compute.device, dtype=torch.float32, requires_grad=True)
            if grads is not None
            else None
        )

    @classmethod
    def gather(
        cls, flat: torch.Tensor, routing: Routing, dtype: torch.dtype, *, trainable: bool, grouped: bool
    ) -> MicrobatchBanks:
        """flat: the optimizer's fp32 master buffer [S, P]. Two kernels (index_select, cast) and, when training, a zeroed
        [G, P] fp32 gradient buffer."""
        with torch.no_grad():
            compute = flat.index_select(0, routing.slot_ids).to(dtype)
            grads = torch.zeros(compute.shape, dtype=torch.float32, device=flat.device) if trainable else None
        return cls(compute, grads, grouped)

    @staticmethod
    def _views(buf: torch.Tensor, layout: BankLayout) -> tuple[torch.Tensor, torch.Tensor]:
        g, n_in, r, n_out = buf.shape[0], layout.in_features, layout.max_rank, layout.out_features
        a = buf[:, layout.a_start : layout.a_start + n_in * r].view(g, n_in, r)
        b = buf[:, layout.b_start : layout.b_start + r * n_out].view(g, r, n_out)
        return a, b

    def weights(self, layout: BankLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """A_g [G, in, r_max], B_g [G, r_max, out]: views of `compute`."""
        return self._views(self.compute, layout)

    def grad_views(self, layout: BankLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fp32 gradient views shaped as `weights` (None when not training)."""
        return None if self.grads is None else self._views(self.grads, layout)


def node_mode(routing: Routing, banks: MicrobatchBanks) -> str:
    """How a LoRA node computes (the module docstring's three ways): "single" (one group, host rank and scale),
    "single_device" (one group over r_max, the scale on the device: a CUDA graph), "grouped" (grouped_mm) or "loop"."""
    if routing.num_groups == 1:
        return "single" if banks.single else "single_device"
    return "grouped" if banks.grouped else "loop"


class _FusedLoraDelta(torch.autograd.Function):
    """delta [N, out] for x [N, in] (see the module docstring); backward returns dx (when x needs it) and accumulates
    dA, dB into the microbatch's fp32 `grads` views."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        trigger: torch.Tensor | None,
        layout: BankLayout,
        banks: MicrobatchBanks,
        routing: Routing,
        base_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.base_weight = base_weight  # frozen: no gradient, and not saved as a tensor (it outlives the step)
        delta = _FusedLoraDelta._delta(ctx, x, layout, banks, routing)
        return delta if base_weight is None else plus_matmul(delta, x, base_weight.t())

    @staticmethod
    def _delta(ctx: Any, x: torch.Tensor, layout: BankLayout, banks: MicrobatchBanks, routing: Routing) -> torch.Tensor:
        a, b = banks.weights(layout)
        if a.dtype != x.dtype:  # activations not in the gathered dtype (e.g. autocast): cast this layer's views
            a, b = a.to(x.dtype), b.to(x.dtype)
        ctx.layout, ctx.banks, ctx.routing = layout, banks, routing
        ctx.mode = node_mode(routing, banks)
        if ctx.mode == "single":
            r, c = routing.ranks[0], routing.scales[0]
            hs = (x @ a[0, :, :r]) * c
            delta = hs @ b[0, :r]
            ctx.save_for_backward(x, hs, a, b)
            return delta
        if ctx.mode == "single_device":
            # A CUDA graph's one group (banks.single False): plain matmuls still, but over r_max (the rank padding is
            # zero, so exact) and with the scale read on the device (routing.row_scales), so nothing of one adapter's
            # rank or scale is baked into the graph. Cheaper than grouped_mm for one group (bench_lora_layer.py).
            hs = x @ a[0]
            hs.mul_(routing.row_scales)  # fp32 scale, one rounding to x.dtype, as `* c` above
            delta = hs @ b[0]
            ctx.save_for_backward(x, hs, a, b)
            return delta
        if ctx.mode == "grouped":
            n_in, r_max, n_out = layout.in_features, layout.max_rank, layout.out_features
            align = alignment(x.dtype)
            pad_in, pad_r, pad_out = (-n_in) % align, (-r_max) % align, (-n_out) % align
            a = F.pad(a, (0, pad_r, 0, pad_in)) if pad_in or pad_r else gmm_operand(a)
            b = F.pad(b, (0, pad_out, 0, pad_r)) if pad_r or pad_out else gmm_operand(b)
            xx = F.pad(x, (0, pad_in)) if pad_in else dense(x)
            hs = grouped_mm(xx, a, offs=routing.offs)
            hs.mul_(routing.row_scales)  # fp32 scale: one rounding to x.dtype, as the reference's `* scale`
            delta = grouped_mm(hs, b, offs=routing.offs)
            ctx.pad_out = pad_out
            ctx.save_for_backward(xx, hs, a, b)
            return delta[:, :n_out] if pad_out else delta
        hs = x.new_zeros(x.shape[0], layout.max_rank)
        delta = x.new_empty(x.shape[0], layout.out_features)
        for g, (start, end, rank, scale) in enumerate(
            zip(routing.starts, routing.ends, routing.ranks, routing.scales, strict=True)
        ):
            h = (x[start:end] @ a[g, :, :rank]) * scale
            hs[start:end, :rank] = h
            delta[start:end] = h @ b[g, :rank]
        ctx.save_for_backward(x, hs, a, b)
        return delta

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, hs, a, b = ctx.saved_tensors
        layout: BankLayout = ctx.layout
        routing: Routing = ctx.routing
        views = ctx.banks.grad_views(layout)
        need_x = ctx.needs_input_grad[0]
        ga, gb = views if views is not None else (None, None)
        dx = None
        if ctx.mode == "single":
            r, c = routing.ranks[0], routing.scales[0]
            if gb is not None:
                accumulate_matmul(gb[0, :r], hs.t(), grad_out)
            if need_x or ga is not None:
                dhs = (grad_out @ b[0, :r].t()) * c
                if ga is not None:
                    accumulate_matmul(ga[0, :, :r], x.t(), dhs)
                if need_x:
                    dx = dhs @ a[0, :, :r].t()
        elif ctx.mode == "single_device":
            if gb is not None:
                accumulate_matmul(gb[0], hs.t(), grad_out)
            if need_x or ga is not None:
                dhs = grad_out @ b[0].t()
                dhs.mul_(routing.row_scales)
                if ga is not None:
                    accumulate_matmul(ga[0], x.t(), dhs)
                if need_x:
                    dx = dhs @ a[0].t()
        elif ctx.mode == "grouped":
            offs = routing.offs
            n_in, r_max, n_out = layout.in_features, layout.max_rank, layout.out_features
            gy = dense(grad_out)  # a zero-stride gradient (y.sum().backward()) breaks grouped_mm
            if ctx.pad_out:
                gy = F.pad(gy, (0, ctx.pad_out))
            if gb is not None:
                gb.add_(grouped_mm(hs.t(), gy, offs=offs)[:, :r_max, :n_out])
            if need_x or ga is not None:
                dhs = grouped_mm(gy, b.transpose(-2, -1), offs=offs)
                dhs.mul_(routing.row_scales)
                if ga is not None:
                    ga.add_(grouped_mm(x.t(), dhs, offs=offs)[:, :n_in, :r_max])
                if need_x:
                    dx = grouped_mm(dhs, a.transpose(-2, -1), offs=offs)
                    dx = dx[:, :n_in] if dx.shape[1] != n_in else dx
        else:
            if need_x:
                dx = x.new_empty(x.shape)
            for g, (start, end, rank, scale) in enumerate(
                zip(routing.starts, routing.ends, routing.ranks, routing.scales, strict=True)
            ):
                gy = grad_out[start:end]
                if gb is not None:
                    accumulate_matmul(gb[g, :rank], hs[start:end, :rank].t(), gy)
                if need_x or ga is not None:
                    dhs = (gy @ b[g, :rank].t()) * scale
                    if ga is not None:
                        accumulate_matmul(ga[g, :, :rank], x[start:end].t(), dhs)
                    if dx is not None:
                        dx[start:end] = dhs @ a[g, :, :rank].t()
        if need_x and ctx.base_weight is not None:
            dx = plus_matmul(dx, grad_out, ctx.base_weight) if dx is not None else grad_out @ ctx.base_weight
        return dx, None, None, None, None, None


def lora_delta_fused(
    x: torch.Tensor,
    layout: BankLayout,
    banks: MicrobatchBanks,
    routing: Routing,
    base_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The LoRA delta [N, out] of x [N, in] for one layer, reading the microbatch's gathered banks (same semantics as
    `lora_delta_reference` on the master banks; see the module docstring). base_weight [out, in] (frozen, x's dtype):
    x @ base_weight^T + delta instead, the base matmul fused in (forward and backward)."""
    if x.dim() != 2 or x.shape[1] != layout.in_features:
        raise ValueError(f"x must be [rows, {layout.in_features}], got shape {tuple(x.shape)}")
    if routing.num_rows != x.shape[0]:
        raise ValueError(f"routing covers {routing.num_rows} rows but the layer sees {x.shape[0]}")
    if banks.compute.shape[0] != routing.num_groups:
        raise ValueError(f"banks gathered for {banks.compute.shape[0]} groups, routing has {routing.num_groups}")
    if base_weight is not None and (base_weight.requires_grad or base_weight.shape != (layout.out_features, x.shape[1])):
        raise ValueError(f"base_weight must be a frozen [{layout.out_features}, {x.shape[1]}] weight")
    return _FusedLoraDelta.apply(x, banks.trigger, layout, banks, routing, base_weight)
