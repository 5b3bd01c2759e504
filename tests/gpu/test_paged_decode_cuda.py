"""The paged decode attention kernel (workers/kernels/triton_paged_decode.py) against the row-by-row reference
(paged_kv.paged_attention_reference): random block tables with blocks shared between rows, lengths from 1 to several
tiles, Qwen3-4B's heads (32 query over 8 kv, head dim 128) and a tiny shape; fp32 (ieee dot products) and bf16; and the
kernel replayed inside a CUDA graph after its tables and lengths changed in place.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from loraplex.workers.sampling.paged_kv import paged_attention, paged_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmul")]
BLOCK = 16


def case(rows: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 3 * rows + 8
    k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to("cuda", dtype)
    v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to("cuda", dtype)
    q = torch.randn(rows, q_heads, dim, generator=gen).to("cuda", dtype)
    lengths = torch.randint(1, 8 * BLOCK + 1, (rows,), generator=gen).tolist()
    # any block may appear in several rows' tables (shared prefixes), in any order
    tables = [torch.randint(0, num_blocks, (-(-n // BLOCK),), generator=gen).tolist() for n in lengths]
    table_t = torch.zeros(rows, 10, dtype=torch.int32)  # wider than any row needs: columns past a length unread
    for r, t in enumerate(tables):
        table_t[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return q, k, v, tables, lengths, table_t.cuda(), torch.tensor(lengths, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(32, 8, 128), (4, 2, 16), (8, 8, 64)])
def test_kernel_equals_reference(dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int) -> None:
    for seed in range(3):
        q, k, v, tables, lengths, table_t, lengths_t = case(37, q_heads, kv_heads, dim, dtype, seed)
        scale = 0.7 / dim**0.5
        got = paged_attention(q, k, v, table_t, lengths_t, scale)
        ref = paged_attention_reference(q.float(), k.float(), v.float(), tables, lengths, scale)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(got.float(), ref, **tol)


def test_kernel_replays_in_a_graph_with_new_tables() -> None:
    q, k, v, tables, lengths, table_t, lengths_t = case(16, 32, 8, 128, torch.bfloat16, 0)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(paged_attention(q, k, v, table_t, lengths_t, 0.1))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(paged_attention(q, k, v, table_t, lengths_t, 0.1))
    q2, _, _, tables2, lengths2, table2, lengths2_t = case(16, 32, 8, 128, torch.bfloat16, 9)
    q.copy_(q2)
    table_t.copy_(table2)
    lengths_t.copy_(lengths2_t)
    graph.replay()
    ref = paged_attention_reference(q.float(), k.float(), v.float(), tables2, lengths2, 0.1)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
