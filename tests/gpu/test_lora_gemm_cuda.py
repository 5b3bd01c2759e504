"""The LoRA gradients' fp32 accumulation on CUDA (`accumulate_matmul`, `matmul_into_float`): a bf16 product summed into
an fp32 gradient by cuBLAS, checked against the fp64 sum at Qwen3-4B's dA / dB shapes over 4,096 rows: for a dense
gradient (one GEMM into it), a column slice of one (a lower rank in a wider bank: the product, then the add), and
replayed from a CUDA graph (the engine's graphed backward). Bound: the fp32 sum's error, K u32 M with 2x slack, far
below the bf16 product's (its rounding alone is u M, u = 2^-8).

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu -s`."""

from __future__ import annotations

import pytest
import torch

from loraplex.workers.lora.gemm import accumulate_matmul, matmul_into_float
from tests.helpers.gpu import QWEN3_4B

ROWS, RANK = 4096, 32
U32 = 2.0**-24


def operands(n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(ROWS, n_in, generator=g, device="cuda").bfloat16()
    dh = torch.randn(ROWS, RANK, generator=g, device="cuda").bfloat16()
    acc = torch.randn(n_in, RANK, generator=g, device="cuda")  # an earlier microbatch's gradient
    return x, dh, acc


def check(got: torch.Tensor, before: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> None:
    exact = before.double() + m1.double() @ m2.double()
    magnitude = before.double().abs() + m1.double().abs() @ m2.double().abs()
    bound = 2 * (m1.shape[1] + 1) * U32 * magnitude
    assert got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("module", sorted(QWEN3_4B))
def test_da_accumulates_in_fp32_dense_and_sliced(module: str) -> None:
    n_in, _ = QWEN3_4B[module]
    x, dh, acc = operands(n_in, seed=len(module))
    before = acc.clone()
    accumulate_matmul(acc, x.t(), dh)  # dense: one GEMM with beta = 1 into acc
    check(acc, before, x.t(), dh)
    wide = torch.randn(n_in, 2 * RANK, device="cuda")
    before = wide.clone()
    accumulate_matmul(wide[:, :RANK], x.t(), dh)  # a rank-32 adapter in a rank-64 bank: strided, product then add
    check(wide[:, :RANK], before[:, :RANK], x.t(), dh)
    assert torch.equal(wide[:, RANK:], before[:, RANK:])


@pytest.mark.gpu
def test_db_accumulates_in_fp32_from_a_replayed_graph() -> None:
    n_out = QWEN3_4B["q_proj"][1]
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(ROWS, RANK, generator=g, device="cuda").bfloat16()
    dy = torch.randn(ROWS, n_out, generator=g, device="cuda").bfloat16()
    grad = torch.zeros(RANK, n_out, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        accumulate_matmul(grad, h.t(), dy)  # warm-up outside the capture (cuBLAS workspace, heuristics)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        accumulate_matmul(grad, h.t(), dy)
    grad.zero_()
    graph.replay()
    graph.replay()  # two microbatches' worth
    twice = torch.cat([h, h]).t()
    check(grad, torch.zeros_like(grad), twice, torch.cat([dy, dy]))
    assert matmul_into_float(h.t(), dy).dtype == torch.float32
