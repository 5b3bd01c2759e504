"""The GEMM primitives every LoRA path shares: `F.grouped_mm` and the operand rules it needs (16-byte alignment,
dense or suitably strided operands), a matmul accumulated in place, and the gradients' fp32 sums from bf16 operands.
Sharp edges of grouped_mm are listed in grouped.py's module docstring; this module is where they are handled once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN_BYTES = 16
# The public name (torch >= 2.10 has it; the GPU image runs 2.11); torch._grouped_mm is the same op in older releases.
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: every grouped_mm leading dimension must be a multiple of this."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def dense(t: torch.Tensor) -> torch.Tensor:
    """t itself when grouped_mm can read it (row-major contiguous, 16-byte aligned base), else a dense copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def gmm_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when grouped_mm can read it as is (16-byte aligned base; one of the last two strides 1 and every other
    stride a multiple of 16 bytes: a column slice of `compute` is such a view when the segment offsets and P are
    multiples of 8 elements, as for every real model shape), else a dense copy."""
    align = alignment(t.dtype)
    strides = t.stride()
    if (
        t.data_ptr() % ALIGN_BYTES == 0
        and 1 in strides[-2:]
        and all(s % align == 0 for i, s in enumerate(strides) if not (s == 1 and i >= t.dim() - 2))
    ):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def plus_matmul(c: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """c + m1 @ m2, in place on c where it is dense (one GEMM with beta = 1; torch.addmm would copy c first)."""
    return c.addmm_(m1, m2) if c.is_contiguous() else torch.addmm(c, m1, m2)


def _fp32_out(m1: torch.Tensor) -> bool:
    """Whether cuBLAS can write fp32 from these 16-bit operands (`out_dtype`: CUDA only)."""
    return m1.is_cuda and m1.dtype in (torch.bfloat16, torch.float16)


def matmul_into_float(m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """m1 @ m2 as fp32 where the operands are 16-bit on CUDA (the GEMM's fp32 accumulator written out, not rounded
    to the operands' dtype first), else in the operands' dtype."""
    return torch.mm(m1, m2, out_dtype=torch.float32) if _fp32_out(m1) else m1 @ m2


def accumulate_matmul(acc: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> None:
    """acc += m1 @ m2 for an fp32 gradient `acc` and 16-bit operands. On CUDA one GEMM with beta = 1 into acc itself
    when it is dense: the product is never rounded to bf16 and no product is written and read back for the add
    (probe_fp32_accumulate.py, Qwen3-4B shapes over 4,096 rows: max error against fp64 ~1e-3 instead of ~1, and
    faster); into a strided acc, the fp32 product and an add. Elsewhere the product in the operands' dtype, added."""
    if _fp32_out(m1) and acc.dtype == torch.float32 and acc.is_contiguous():
        torch.addmm(acc, m1, m2, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(matmul_into_float(m1, m2))
