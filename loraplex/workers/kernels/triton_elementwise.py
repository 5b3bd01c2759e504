"""Triton kernels for the frozen base model's RMSNorm and the gated MLP's silu(gate) * up (CUDA only).

HF's RMSNorm is about seven kernels forward (cast to fp32, square, mean, add eps, rsqrt, multiply, cast back, weight)
and more backward, each reading and writing the whole activation in fp32; the MLP's activation is two more. Here each
is one kernel forward and one backward with the same maths: fp32 statistics, the normalised value cast back to the
input dtype before the weight multiplies it, as HF's. The base weights are frozen, so no weight gradient is computed
(the kernels refuse a weight that requires grad). The plain-torch reference is HF's eager module itself
(tests/gpu/test_fused_elementwise_cuda.py).

Imported only where triton is (the GPU image): workers/kernels/fused_elementwise.py decides.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, inner, stride_outer, stride_inner, eps, BLOCK: tl.constexpr):  # noqa: N803
    # x is [outer, inner, n_cols] with these strides (its last dim contiguous): a column block of a wider output reads
    # in place; y is contiguous
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_row = (row // inner) * stride_outer + (row % inner) * stride_inner
    x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    h = (x * rstd).to(w.dtype)
    tl.store(y_ptr + row * n_cols + cols, w * h, mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # d(w * h)/dh in the dtype the forward multiplied in, then through the cast back to fp32 (an identity there)
    g = (tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0) * w).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    xhat = x * rstd
    dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
    tl.store(dx_ptr + row * n_cols + cols, dx.to(x_ptr.dtype.element_ty), mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        cols = shape[-1]
        # Without a gradient, a [rows, cols] or [rows, heads, cols] view with a contiguous last dim is read in place
        # (the decode step's q and k, column blocks of one q/k/v product); else a contiguous copy, kept for backward.
        strided = not ctx.needs_input_grad[0] and x.dim() in (2, 3) and x.stride(-1) == 1
        x3 = (x if x.dim() == 3 else x.unsqueeze(1)) if strided else x.reshape(-1, 1, cols).contiguous()
        rows = x3.shape[0] * x3.shape[1]
        y = torch.empty(rows, cols, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        block = triton.next_power_of_2(cols)
        _rms_fwd[(rows,)](x3, weight, y, rstd, cols, x3.shape[1], x3.stride(0), x3.stride(1), eps, BLOCK=block,
                          num_warps=min(16, max(1, block // 256)))  # fmt: skip
        if not strided:
            ctx.save_for_backward(x3.view(rows, cols), weight, rstd)
        ctx.shape, ctx.block = shape, block
        return y.view(*shape[:-1], cols)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        dx = torch.empty_like(x2)
        block = ctx.block
        _rms_bwd[(rows,)](dy2, x2, weight, rstd, dx, cols, BLOCK=block, num_warps=min(16, max(1, block // 256)))
        return dx.view(ctx.shape), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of x [..., D] with a frozen weight [D], in one kernel each way."""
    if weight.requires_grad:
        raise ValueError("the Triton RMSNorm computes no weight gradient: the weight must be frozen")
    return _RMSNorm.apply(x, weight, eps)


@triton.jit
def _silu_mul_fwd(g_ptr, u_ptr, y_ptr, n, n_cols, stride_g, stride_u, BLOCK: tl.constexpr):  # noqa: N803
    # gate and up are [n / n_cols, n_cols] with these row strides (column blocks of one gate/up product read in
    # place); y is contiguous
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, col = offs // n_cols, offs % n_cols
    g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=mask, other=0.0)
    silu = (g * tl.sigmoid(g)).to(u.dtype)  # as F.silu in the input dtype, then the product in it
    tl.store(y_ptr + offs, silu * u, mask=mask)


@triton.jit
def _silu_mul_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(u.dtype)
    tl.store(du_ptr + offs, dy * silu, mask=mask)
    dsilu = (dy * u).to(tl.float32)
    tl.store(dg_ptr + offs, (dsilu * sig * (1.0 + g * (1.0 - sig))).to(u.dtype), mask=mask)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows_in_place = not grad and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
        g, u = (gate, up) if rows_in_place else (gate.contiguous(), up.contiguous())
        cols = g.shape[-1]
        y = torch.empty(g.shape, device=g.device, dtype=g.dtype)
        n = y.numel()
        stride_g, stride_u = (g.stride(0), u.stride(0)) if rows_in_place else (cols, cols)
        _silu_mul_fwd[(triton.cdiv(n, 1024),)](g, u, y, n, cols, stride_g, stride_u, BLOCK=1024)
        if grad:
            ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = u.numel()
        _silu_mul_bwd[(triton.cdiv(n, 1024),)](dy, g, u, dg, du, n, BLOCK=1024)
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up (same shapes and dtype), one kernel each way."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError("gate and up must have the same shape and dtype")
    return _SiluMul.apply(gate, up)


@triton.jit
def _rope_fwd(x_ptr, cos_ptr, sin_ptr, y_ptr, heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):  # noqa: N803
    # one token's heads: y = x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype as HF's
    # three elementwise ops round them
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None]
    partner = (d + half) % HEAD_DIM
    row = x_ptr + t * heads * HEAD_DIM + h[:, None] * HEAD_DIM
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rot = tl.where((d < half)[None, :], -xp, xp)
    c = tl.load(cos_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    dt = x.dtype
    y = (x.to(tl.float32) * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)
    tl.store(y_ptr + t * heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], y.to(dt), mask=mask)


@triton.jit
def _rope_bwd(dy_ptr, cos_ptr, sin_ptr, dx_ptr, heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):  # noqa: N803
    # dx = dy * cos + rotate_half^T(dy * sin): rotate_half^T(u)[j] = u[j + half] below half, -u[j - half] above
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None]
    partner = (d + half) % HEAD_DIM
    row = dy_ptr + t * heads * HEAD_DIM + h[:, None] * HEAD_DIM
    g = tl.load(row + d[None, :], mask=mask, other=0.0)
    gp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    sp = tl.load(sin_ptr + t * HEAD_DIM + partner).to(tl.float32)[None, :]
    dt = g.dtype
    up = (gp * sp).to(dt).to(tl.float32)
    rot = tl.where((d < half)[None, :], up, -up)
    dx = (g.to(tl.float32) * c).to(dt).to(tl.float32) + rot
    tl.store(dx_ptr + t * heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], dx.to(dt), mask=mask)


def _rope_launch(kernel: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, D] contiguous, cos/sin [tokens, D] contiguous -> a new [tokens, heads, D]."""
    tokens, heads, dim = x.shape
    y = torch.empty_like(x)
    block_h = min(16, triton.next_power_of_2(heads))
    kernel[(tokens, triton.cdiv(heads, block_h))](x, cos, sin, y, heads, HEAD_DIM=dim, BLOCK_H=block_h, num_warps=4)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(cos, sin)
        return _rope_launch(_rope_fwd, q, cos, sin), _rope_launch(_rope_fwd, k, cos, sin)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        out = [_rope_launch(_rope_bwd, g.contiguous(), cos, sin) if g is not None else None for g in (dq, dk)]
        return out[0], out[1], None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb for q [tokens, q_heads, D] and k [tokens, kv_heads, D] (contiguous, the heads of a
    token side by side) with cos/sin [tokens, D] (no gradient), one kernel per tensor each way."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("the Triton rotary embedding computes no gradient for cos/sin")
    if q.shape[-1] % 2 or q.shape[-1] & (q.shape[-1] - 1):
        raise ValueError("the Triton rotary embedding needs a power-of-two head dim")
    return _Rope.apply(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())
