"""Decode attention over a paged KV cache as one Triton kernel (CUDA only): each row reads only the blocks its table
names, up to its length, instead of a dense [rows, T] cache or a gathered copy of the blocks.

Semantics: `paged_kv.paged_attention_reference` (query head h reads kv head h // (q_heads // kv_heads); row r attends
to its first lengths[r] positions, position p at slot tables[r, p // block_tokens] * block_tokens + p % block_tokens),
checked by tests/gpu/test_paged_decode_cuda.py.

One program per (row, kv head): the kv head's group of query heads (4 for Qwen3-4B) is one [GROUP_PAD, D] tile,
padded to 16 rows because tl.dot needs 16; the row's positions go by in tiles of TILE tokens (gathered through the
block table, so several blocks per tile), with the online softmax of flash attention in fp32. Lengths and tables are
read from device memory, so the launch has no host-dependent shape and a CUDA graph can capture it.

Not split along the positions (flash-decoding's split-K): with R rows x kv heads programs (2,048 at 256 rows of
Qwen3-4B) an H100's 132 SMs are full; a handful of rows with very long contexts would leave SMs idle.

Imported only where triton is (the GPU image): paged_kv.paged_attention decides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(  # noqa: PLR0913
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lengths_ptr,
    out_ptr,
    scale,
    table_stride,
    KV_HEADS: tl.constexpr,  # noqa: N803
    GROUP: tl.constexpr,  # noqa: N803
    GROUP_PAD: tl.constexpr,  # noqa: N803
    HEAD_DIM: tl.constexpr,  # noqa: N803
    BLOCK_TOKENS: tl.constexpr,  # noqa: N803
    TILE: tl.constexpr,  # noqa: N803
    IEEE: tl.constexpr,  # noqa: N803
):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    length = tl.load(lengths_ptr + row).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    q_off = row * (KV_HEADS * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(g < GROUP)[:, None], other=0.0)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    den = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    for start in range(0, length, TILE):
        pos = start + t
        valid = pos < length
        block = tl.load(tables_ptr + row * table_stride + pos // BLOCK_TOKENS, mask=valid, other=0).to(tl.int64)
        slot = block * BLOCK_TOKENS + pos % BLOCK_TOKENS
        kv_off = slot[:, None] * (KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 - a constexpr branch triton resolves at compile time
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 - a constexpr branch triton resolves at compile time
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / den[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    tile: int = 64,
) -> torch.Tensor:
    """q [rows, Hq, D]; k_cache / v_cache [num_blocks, block_tokens, Hkv, D] (contiguous); tables [rows, width] int
    (int32 or int64); lengths [rows] (each >= 1). Returns [rows, Hq, D] in q's dtype."""
    rows, q_heads, dim = q.shape
    _, block_tokens, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    q = q.contiguous()
    tables = tables.contiguous()
    out = torch.empty_like(q)
    _paged_decode[(rows, kv_heads)](
        q,
        k_cache,
        v_cache,
        tables,
        lengths,
        out,
        float(scale),
        tables.stride(0),
        KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        BLOCK_TOKENS=block_tokens,
        TILE=tile,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out
