"""The fused LoRA delta: two `F.grouped_mm` calls over the adapter groups of a mixed microbatch, no Python loop.

Semantics (plain torch; equal to `lora_delta_reference` whenever the bank's rank padding is zero, the slot-bank invariant):

    A = a_bank[routing.slot_ids].to(x.dtype)               # [G, in, r_max]  (gathered once per layer call)
    B = b_bank[routing.slot_ids].to(x.dtype)               # [G, r_max, out]
    h = cat([x[rows_g] @ A[g] for g])                      # F.grouped_mm(x, A, offs=routing.offs)  -> [N, r_max]
    h = h * routing.row_scales                             # per-row alpha_g / r_g (fp32 maths, one rounding)
    delta = cat([h[rows_g] @ B[g] for g])                  # F.grouped_mm(h, B, offs=routing.offs)  -> [N, out]

Zero padding of ranks is exact, in the outputs and in the gradients, because the padding is zero (the engine keeps it so:
a slot is zeroed on create/delete/load and the optimizer moves only the real-rank part):
  * output: columns r_g.. of A[g] are zero, so h[rows_g, r_g:] == 0 exactly and rows r_g.. of B[g] meet only zeros;
  * dA[g][:, r_g:] = x_g^T @ (dY_g @ B[g][r_g:]^T * c_g) = x_g^T @ 0 = 0 exactly (rows r_g.. of B[g] are zero);
  * dB[g][r_g:]    = h_g[:, r_g:]^T @ dY_g = 0 exactly (those columns of h are zero).
So the padded gradient entries are exact zeros (not just small): the per-adapter grad norm and clipping see the same
numbers as the reference path, and the optimizer, which only updates the real-rank part anyway, keeps the padding zero.
(With a non-finite incoming gradient the padding can turn NaN, 0 * inf; that step's norm is non-finite for the adapter's
real part too, so the optimizer skips it and clears the slot's gradients whole.) Unlike the reference loop, this op
*reads* the padding: a bank whose padding is not zero breaks the precondition and gives different results.

Sharp edges of `grouped_mm` (../shared/reference/platform.md) and how they are handled here:
  1. a zero-stride (or otherwise non-dense) incoming gradient, as from `y.sum().backward()`, breaks grouped_mm's backward:
     the custom autograd Function makes the gradient dense and 16-byte aligned before any grouped GEMM;
  2. rows past offs[-1] come back as garbage: the op refuses a routing that does not cover exactly x.shape[0] rows;
  3. offs must be int32: Routing.build makes them so, once per microbatch;
  4. every leading stride must be a multiple of 16 bytes (bf16: dims multiple of 8; fp32: of 4) and every base pointer
     16-byte aligned: r_max, in and out are zero-padded up to the alignment when needed (exact: zeros contribute nothing;
     the output is sliced back), and a misaligned or non-contiguous x is copied. Real model shapes need no padding
     (Qwen3-4B: 2560, 9728, 4096, 1024 and rank 32 are all multiples of 8);
  5. no bias, out_dtype = input dtype: neither is used.
A single-group microbatch takes the plain-matmul path (`lora_delta_single`), as in the reference.

Not built (documented for later): one GEMM for the A products of layers that share their input. q_proj, k_proj and
v_proj all read the same x (the attention block's normed hidden states); gate_proj and up_proj share the MLP's. With the
three A banks stored as one parameter A_qkv [S, in, 3 r_max] (q, k, v blocks side by side; each module's lora_A a view):
  * forward: h = grouped_mm(x, A_qkv[slot_ids], offs) -> [N, 3 r_max], one `mul_(row_scales)`, then each module takes its
    column block h[:, i r_max:(i+1) r_max] - a strided view (stride 3 r_max, 16-byte aligned), valid grouped_mm input
    with no copy - for its own B GEMM (the B products stay separate: different out dims);
  * backward: the three dh blocks are written into one [N, 3 r_max] buffer, and then dx = dh @ A_qkv^T is ONE GEMM that
    already sums the three modules' contributions (the sum over the concatenated rank dim), and dA_qkv = x^T @ dh is one;
  * per attention block that is 1 A-GEMM instead of 3 forward, 2 GEMMs instead of 6 (+2 adds) backward, one gather + cast
    of A instead of 3, and x read once instead of three times; gate/up the same with 2. At Qwen3-4B shapes the work is
    tiny (r = 32), so the win is mostly launches and host time, which is what small steps are bound by.
  * what it needs: a hook at the attention / MLP module (not the Linear) that computes h once per microbatch and hands
    the blocks to its SlotBankLinears (e.g. through the LoraContext); the optimizer's real-rank mask for such a bank
    becomes `(position % r_max) < rank` (same rank for the three modules of one adapter); adapter_weights / export slice
    per module as today (views), and `create_adapter`'s seeded init must stay per module so weights do not change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from loraplex.workers.lora.gemm import alignment, dense, grouped_mm
from loraplex.workers.lora.reference import lora_delta_single
from loraplex.workers.lora.routing import Routing


class GroupedLoraDelta(torch.autograd.Function):
    """delta = grouped_mm(grouped_mm(x, A, offs) * row_scales, B, offs), with a hand-written backward.

    Inputs are already gathered, cast and padded: x [N, K], A [G, K, R], B [G, R, O] (all in x.dtype, grouped_mm-ready),
    row_scales fp32 [N, 1], offs int32 [G] with offs[-1] == N. Backward (per group g, rows_g; c = row scale):
        hs     = (x @ A[g]) * c                 saved from forward ([N, R], small)
        dB[g]  = hs_g^T @ dY_g                  grouped_mm(hs.t(), dY, offs)          (2D x 2D, groups on the K dim)
        dhs    = (dY_g @ B[g]^T) * c            grouped_mm(dY, B.transpose(-2, -1), offs) * row_scales
        dx_g   = dhs_g @ A[g]^T                 grouped_mm(dhs, A.transpose(-2, -1), offs)
        dA[g]  = x_g^T @ dhs_g                  grouped_mm(x.t(), dhs, offs)
    An empty group gets dA = dB = 0 (grouped_mm writes zeros for an empty K range on CPU and sm90)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        row_scales: torch.Tensor,
        offs: torch.Tensor,
    ) -> torch.Tensor:
        h = grouped_mm(x, a, offs=offs)
        h.mul_(row_scales)  # fp32 scale: computed in fp32, rounded once to x.dtype (as the reference's `* scale`)
        ctx.save_for_backward(x, a, b, h, row_scales, offs)
        return grouped_mm(h, b, offs=offs)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a, b, hs, row_scales, offs = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        gy = dense(grad_out)  # sharp edge 1: y.sum().backward() hands in a zero-stride gradient
        grad_x = grad_a = grad_b = None
        if need_b:
            grad_b = grouped_mm(hs.t(), gy, offs=offs)
        if need_x or need_a:
            ghs = grouped_mm(gy, b.transpose(-2, -1), offs=offs)
            ghs.mul_(row_scales)
            if need_x:
                grad_x = grouped_mm(ghs, a.transpose(-2, -1), offs=offs)
            if need_a:
                grad_a = grouped_mm(x.t(), ghs, offs=offs)
        return grad_x, grad_a, grad_b, None, None


def lora_delta_grouped(x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor, routing: Routing) -> torch.Tensor:
    """LoRA delta of a mixed-adapter microbatch with two grouped GEMMs; same signature and semantics as
    `lora_delta_reference` (see this module's docstring for the plain-torch statement and the padding argument).

    x: [N, in] in the compute dtype; a_bank [S, in, r_max], b_bank [S, r_max, out] (fp32 masters, cast to x.dtype after
    the gather, so gradients flow back to the masters in fp32). Returns [N, out] in x.dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, in], got shape {tuple(x.shape)}")
    if routing.num_rows != x.shape[0]:
        # Sharp edge 2: rows past offs[-1] would come back as uninitialised memory, so they are refused outright.
        raise ValueError(f"routing covers {routing.num_rows} rows but the layer sees {x.shape[0]}")
    if routing.num_groups == 1:
        return lora_delta_single(x, a_bank, b_bank, routing)
    n_in, n_out = x.shape[1], b_bank.shape[2]
    if a_bank.shape[1] != n_in or a_bank.shape[2] != b_bank.shape[1]:
        raise ValueError(
            f"bank shapes A {tuple(a_bank.shape)} and B {tuple(b_bank.shape)} do not fit x {tuple(x.shape)}"
        )
    align = alignment(x.dtype)
    pad_in, pad_r, pad_out = (-n_in) % align, (-a_bank.shape[2]) % align, (-n_out) % align
    a = a_bank.index_select(0, routing.slot_ids).to(x.dtype)
    b = b_bank.index_select(0, routing.slot_ids).to(x.dtype)
    if pad_in or pad_r:
        a = F.pad(a, (0, pad_r, 0, pad_in))
    if pad_r or pad_out:
        b = F.pad(b, (0, pad_out, 0, pad_r))
    x = F.pad(x, (0, pad_in)) if pad_in else dense(x)
    delta = GroupedLoraDelta.apply(x, a, b, routing.row_scales, routing.offs)
    return delta[:, :n_out] if pad_out else delta
