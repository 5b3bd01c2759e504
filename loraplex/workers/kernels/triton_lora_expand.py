"""`lora_expand.masked_expand` as one Triton kernel (CUDA only): semantics and the plain-torch reference in
workers/kernels/lora_expand.py, checked by tests/gpu/test_lora_expand_cuda.py.

One program per [BLOCK_M, BLOCK_N] tile of `out`: for each segment whose columns meet the tile, the K loop loads the
mask's block (32 columns: one LoRA group at rank 32) and, unless it is all 0 for the tile's rows (no row of the tile
uses those groups: a run's rows sit next to each other, so a tile rarely holds more than one or two adapters), h's
block, multiplies them in fp32, rounds to the compute dtype and accumulates its product with B's columns (those
outside the segment load as 0); the tile's sum is added to `out` in fp32 and rounded once. The
segments' bounds are read from device memory and every shape is fixed by the step's rows, so a CUDA graph captures it.

Imported only where triton is (the GPU image): lora_expand.masked_expand decides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _masked_expand(  # noqa: PLR0913
    out_ptr,
    h_ptr,
    mask_ptr,
    b_ptr,
    bounds_ptr,
    rows,
    cols,
    out_stride,
    h_stride,
    mask_stride,
    b_stride,
    WIDTH: tl.constexpr,  # noqa: N803
    SEGMENTS: tl.constexpr,  # noqa: N803
    BLOCK_M: tl.constexpr,  # noqa: N803
    BLOCK_N: tl.constexpr,  # noqa: N803
    BLOCK_K: tl.constexpr,  # noqa: N803
    IEEE: tl.constexpr,  # noqa: N803
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    row_ok = rm < rows
    rm64 = rm.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in tl.static_range(SEGMENTS):
        lo = tl.load(bounds_ptr + 2 * s)
        hi = tl.load(bounds_ptr + 2 * s + 1)
        if (n0 < hi) & (n0 + BLOCK_N > lo):
            in_segment = (rn >= lo) & (rn < hi)
            for k0 in range(0, WIDTH, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_ok = rk < WIDTH
                ok = row_ok[:, None] & k_ok[None, :]
                m = tl.load(mask_ptr + rm64[:, None] * mask_stride + rk[None, :], mask=ok, other=0.0)
                # A block of groups none of the tile's rows uses (its mask all 0) adds nothing: skip reading its B.
                if tl.max(tl.abs(m)) > 0:
                    h = tl.load(h_ptr + rm64[:, None] * h_stride + s * WIDTH + rk[None, :], mask=ok, other=0.0)
                    a = (h.to(tl.float32) * m).to(h.dtype)
                    b = tl.load(
                        b_ptr + rk[:, None].to(tl.int64) * b_stride + rn[None, :],
                        mask=k_ok[:, None] & in_segment[None, :],
                        other=0.0,
                    )
                    if IEEE:
                        acc += tl.dot(a, b, input_precision="ieee")
                    else:
                        acc += tl.dot(a, b)
    ok = row_ok[:, None] & (rn < cols)[None, :]
    at = out_ptr + rm64[:, None] * out_stride + rn[None, :]
    base = tl.load(at, mask=ok, other=0.0)
    tl.store(at, (base.to(tl.float32) + acc).to(base.dtype), mask=ok)


def masked_expand_kernel(
    out: torch.Tensor, h: torch.Tensor, mask: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor
) -> None:
    """out [M, N] += per segment (h_s * mask) @ B[:, segment] (lora_expand.py); bounds int32 [S, 2] on the device."""
    rows, cols = out.shape
    width = mask.shape[1]
    if h.stride(1) != 1 or mask.stride(1) != 1 or b.stride(1) != 1 or bounds.dtype != torch.int32:
        raise ValueError("masked_expand_kernel needs unit column strides and int32 bounds")
    block_m = 16 if rows <= 16 else 32 if rows <= 64 else 64
    block_n = 128
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _masked_expand[grid](
        out,
        h,
        mask,
        b,
        bounds,
        rows,
        cols,
        out.stride(0),
        h.stride(0),
        mask.stride(0),
        b.stride(0),
        WIDTH=width,
        SEGMENTS=bounds.shape[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=32,
        IEEE=out.dtype == torch.float32,  # fp32 exact, as the reference's matmul (tf32 would round)
        num_warps=4,
    )
