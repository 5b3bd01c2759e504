"""The tensors of a paged KV cache and a plain-torch paged attention for one decode step.

Per layer K and V are [num_blocks, block_tokens, kv_heads, head_dim]; a row's positions live in the blocks of its block
table (kv_blocks.BlockAllocator), position p at slot `table[p // block_tokens] * block_tokens + p % block_tokens` of
the flattened [num_blocks * block_tokens, kv_heads, head_dim] view. Rows of any lengths share one pool, and rows with
a common prefix share its blocks, so memory follows the tokens actually held instead of rows x the longest row.

Attention for a decode step (one query token per row, already written into the cache, so a row of length n attends
to its positions [0, n)), GQA (query head h reads kv head h // (q_heads // kv_heads), as transformers' repeat_kv does):

  * `paged_attention_reference`: a loop over rows, each gathering its own blocks: the specification.
  * `paged_attention_gathered`: every row at once, the tables' blocks gathered into a dense copy and the positions
    past each row's length masked: the plain-torch form (the CPU path), checked against the loop.
  * `paged_attention`: what the decoder calls: on CUDA where triton is, the kernel of
    workers/kernels/triton_paged_decode.py (each row reads only its own blocks, up to its length; checked against the
    reference in tests/gpu/test_paged_decode_cuda.py); else `paged_attention_gathered`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


class PagedKvCache:
    """K and V blocks for every layer, written through slots, copied block-wise for copy-on-write."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, block_tokens, kv_heads, head_dim)
        self.block_tokens = block_tokens
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes one block takes over all layers, K and V: what sizes the pool from the memory left free."""
        return 2 * num_layers * block_tokens * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' k, v [n, kv_heads, head_dim] at `slots` [n] (block_id * block_tokens + offset), all
        rows in one index_put."""
        self.k[layer].view(-1, *self.k[layer].shape[2:]).index_put_((slots,), k)
        self.v[layer].view(-1, *self.v[layer].shape[2:]).index_put_((slots,), v)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks `src` [n] into `dst` [n] in every layer (the allocator's CopyOnWrite, batched)."""
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def block_table_tensor(tables: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Block tables as one int64 [rows, longest table] tensor; short tables padded with block 0 (masked by length)."""
    width = max((len(t) for t in tables), default=0)
    out = torch.zeros((len(tables), max(width, 1)), dtype=torch.long)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return out.to(device)


def slots_for(tables: torch.Tensor, positions: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """The slot of position positions[r] of row r, for block tables [rows, width]: one gather, no Python loop."""
    block = tables.gather(1, (positions // block_tokens).unsqueeze(1)).squeeze(1)
    return block * block_tokens + positions % block_tokens


def _gqa_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [R, Hq, D], k/v [R, T, Hkv, D], mask [R, T] (True = attend) -> [R, Hq, D]."""
    rows, q_heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.view(rows, kv_heads, q_heads // kv_heads, dim).float()
    scores = torch.einsum("rhgd,rthd->rhgt", qg, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("rhgt,rthd->rhgd", scores.softmax(dim=-1), v.float())
    return out.reshape(rows, q_heads, dim).to(q.dtype)


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query heads {tuple(q.shape[1:])} do not group onto the cache's kv heads {k_cache.shape[2:]}")


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: Sequence[Sequence[int]],
    lengths: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention row by row: row r's query q[r] [Hq, D] over its first lengths[r] cached positions, gathered
    from its blocks of k_cache/v_cache [num_blocks, block_tokens, Hkv, D]. Returns [rows, Hq, D]."""
    _check_heads(q, k_cache)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = []
    for r, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        blocks = torch.as_tensor(list(table), dtype=torch.long, device=k_cache.device)
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        out.append(_gqa_attend(q[r : r + 1], k.unsqueeze(0), v.unsqueeze(0), None, scale))
    return torch.cat(out) if out else q.new_empty(q.shape)


def paged_attention_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention for every row at once: tables [rows, width] (block_table_tensor), lengths [rows] (each >= 1);
    the blocks gathered into [rows, width * block_tokens, Hkv, D] and the positions past each row's length masked.
    Equal to paged_attention_reference; returns [rows, Hq, D]."""
    _check_heads(q, k_cache)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows, width = tables.shape
    k = k_cache[tables].flatten(1, 2)
    v = v_cache[tables].flatten(1, 2)
    positions = torch.arange(width * k_cache.shape[1], device=q.device)
    mask = positions.unsqueeze(0) < lengths.to(q.device).unsqueeze(1)
    return _gqa_attend(q, k, v, mask, scale)


@functools.cache
def _kernel_available() -> bool:
    from loraplex.workers.kernels.fused_elementwise import available

    return available()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The decode step's paged attention (see the module docstring): the Triton kernel on CUDA (head dim a power of two
    >= 16), `paged_attention_gathered` elsewhere. Same arguments and result as paged_attention_gathered."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dim = q.shape[-1]
    if q.is_cuda and dim >= 16 and dim & (dim - 1) == 0 and _kernel_available():
        _check_heads(q, k_cache)
        from loraplex.workers.kernels.triton_paged_decode import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale)
    return paged_attention_gathered(q, k_cache, v_cache, tables, lengths, scale)
