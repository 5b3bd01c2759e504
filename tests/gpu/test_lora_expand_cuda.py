"""The masked LoRA expand kernel (workers/kernels/triton_lora_expand.py) against its plain-torch reference
(lora_expand.masked_expand_reference) on random inputs: Qwen3-4B's q/k/v, gate/up and o shapes at decode row counts
from 1 to 1,024, a point whose middle projection is not wrapped, bf16 and fp32, and replayed in a CUDA graph after
the mask changed in place.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from loraplex.workers.kernels.lora_expand import masked_expand, masked_expand_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmul")]


def case(rows: int, widths: tuple[int, ...], wrapped: tuple[int, ...], groups: int, rank: int, dtype: torch.dtype,
         seed: int) -> tuple:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    width = groups * rank
    starts = [sum(widths[:i]) for i in range(len(widths))]
    segments = [(starts[i], starts[i] + widths[i]) for i in wrapped]
    h = torch.randn(rows, len(wrapped) * width, generator=gen).to("cuda", dtype)
    b = (torch.randn(width, sum(widths), generator=gen) * 0.1).to("cuda", dtype)
    out = torch.randn(rows, sum(widths), generator=gen).to("cuda", dtype)
    row_group = torch.randint(0, groups + 1, (rows,), generator=gen)  # group `groups`: a base row
    scales = torch.rand(groups + 1, generator=gen) * 2
    scales[groups] = 0.0
    mask = torch.zeros(rows, width)
    for m, g in enumerate(row_group.tolist()):
        if g < groups:
            mask[m, g * rank : (g + 1) * rank] = scales[g]
    return out, h, mask.cuda(), b, segments


QKV = ((4096, 1024, 1024), (0, 1, 2))
GATE_UP = ((9728, 9728), (0, 1))
OUT_PROJ = ((2560,), (0,))
GAP = ((256, 100, 256), (0, 2))  # the middle projection not a LoRA target; widths not multiples of a tile


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("widths", "wrapped"), [QKV, GATE_UP, OUT_PROJ, GAP])
@pytest.mark.parametrize("rows", [1, 8, 37, 256, 1024])
def test_kernel_equals_reference(dtype: torch.dtype, widths: tuple, wrapped: tuple, rows: int) -> None:
    out, h, mask, b, segments = case(rows, widths, wrapped, groups=8, rank=32, dtype=dtype, seed=rows)
    want = out.clone()
    masked_expand_reference(want, h, mask, b, segments)
    got = out.clone()
    masked_expand(got, h, mask, b, segments)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    untouched = [c for c in range(out.shape[1]) if not any(lo <= c < hi for lo, hi in segments)]
    assert torch.equal(got[:, untouched], out[:, untouched])


def test_kernel_in_a_cuda_graph_reads_the_mask_in_place() -> None:
    out, h, mask, b, segments = case(64, *QKV, groups=4, rank=16, dtype=torch.bfloat16, seed=5)
    bounds = torch.tensor(segments, dtype=torch.int32, device="cuda")
    target = out.clone()
    masked_expand(target, h, mask, b, segments, bounds)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        target.copy_(out)
        masked_expand(target, h, mask, b, segments, bounds)
    mask.mul_(-0.5)
    graph.replay()
    want = out.clone()
    masked_expand_reference(want, h, mask, b, segments)
    torch.testing.assert_close(target, want, atol=2e-2, rtol=2e-2)
