"""The decode step's LoRA expand with the per-row adapter mask: `out[:, lo_s:hi_s] += (h_s * mask) @ B[:, lo_s:hi_s]`
for each segment s (one wrapped projection of a group that reads one input: q/k/v, gate/up, or o / down alone).

    out  [M, N]      the base product's output (the stacked q/k/v or gate/up product: each projection a column block)
    h    [M, S * W]  the shrink x @ A_cat: segment s's block is columns [s * W, (s + 1) * W)
    mask [M, W]      fp32: row m's adapter scale on its LoRA group's r columns, 0 elsewhere (W = groups * r)
    B    [W, N]      every group's B of each projection, in the projection's columns
    segments         ((lo, hi) per segment, in h's block order): the columns each segment adds into

The masked h is rounded once to the compute dtype before the product (what `h.mul_(mask)` does on the plain path).

  * `masked_expand_reference`: plain torch, one mask multiply and one addmm per segment (the specification).
  * `masked_expand`: on CUDA where triton is, workers/kernels/triton_lora_expand.py: ONE kernel per group of
    projections instead of 1 + S (the mask multiply and each projection's addmm), on a step whose LoRA side path was
    ~15 small kernels a layer; tests/gpu/test_lora_expand_cuda.py compares the two on random inputs. The sampler
    runs it only when asked (`Sampler(expand_kernel=True)`): its first version, which read every group's B in each
    tile, lost 5% to the reference's cuBLAS products on an H100 at 8 LoRA groups (benchmarks/RESULTS.md, Session
    19); the version here, which skips the groups a tile's rows do not use, is not measured on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def masked_expand_reference(
    out: torch.Tensor, h: torch.Tensor, mask: torch.Tensor, b: torch.Tensor, segments: Sequence[tuple[int, int]]
) -> None:
    width = mask.shape[1]
    wide = torch.promote_types(h.dtype, torch.float32)  # the mask's fp32 scales, one rounding to h's dtype
    for s, (lo, hi) in enumerate(segments):
        masked = (h[:, s * width : (s + 1) * width].to(wide) * mask).to(h.dtype)
        out[:, lo:hi].addmm_(masked, b[:, lo:hi])


def kernel_usable(out: torch.Tensor) -> bool:
    """Whether `masked_expand` runs the Triton kernel for this output (CUDA, triton importable)."""
    if not out.is_cuda or out.stride(1) != 1:
        return False
    from loraplex.workers.kernels.fused_elementwise import available

    return available()


def masked_expand(
    out: torch.Tensor,
    h: torch.Tensor,
    mask: torch.Tensor,
    b: torch.Tensor,
    segments: Sequence[tuple[int, int]],
    bounds: torch.Tensor | None = None,
    kernel: bool = True,
) -> None:
    """In place into `out` (see the module docstring). bounds: `segments` as an int32 [S, 2] tensor on out's device
    (the kernel reads it; a caller that captures the step in a CUDA graph makes it once); kernel False: the
    reference wherever it runs."""
    if not (kernel and kernel_usable(out)):
        masked_expand_reference(out, h, mask, b, segments)
        return
    from loraplex.workers.kernels.triton_lora_expand import masked_expand_kernel

    if bounds is None:
        bounds = torch.tensor(segments, dtype=torch.int32, device=out.device)
    masked_expand_kernel(out, h, mask, b, bounds)
