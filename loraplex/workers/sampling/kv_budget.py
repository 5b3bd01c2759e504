"""How many KV blocks the native sampler's paged cache gets, and how many rows it decodes at once. Pure arithmetic
(no torch): the pool process measures the memory and passes the numbers in (pool/process.py `sampler_budget`).

The rule, in order:
1. Memory the pool could give the cache: on CUDA the device's free memory once the engine is built (the driver's free
   bytes plus what torch's allocator holds unused); on the CPU no such number means anything (the host's memory is
   shared with everything else), so a configured byte budget (`LORAPLEX_SAMPLER_KV_BYTES`, default `CPU_KV_BYTES`).
2. Training keeps its share: the cache takes at most `LORAPLEX_SAMPLER_KV_MEMORY_FRACTION` (default 0.25) of that
   free memory, and never more than the free memory less `reserve_bytes` (a measured peak of a full microbatch step,
   when the caller has one): cache = min(fraction x free, free - reserve). The rest is what a training step's
   activations (a Qwen3-4B-shaped 3,840-token microbatch held 14.4 GiB for its backward on an H100), its CUDA-graph
   pools (6.8 GiB) and the sampler's per-step temporaries (each row's draw over the vocabulary). Measured on an H100
   with 63 GiB free after the bf16 weights, with the dense decoder of the time (a cache per run and row shape): 0.5
   (448 rows) served one RL tenant and ran out of memory with four, 0.25 (224 rows) served both (bench_rl.py); the
   paged decoder's one shared cache holds exactly these blocks, so a larger fraction may fit now (not measured).
   `LORAPLEX_SAMPLER_KV_BYTES` set on CUDA replaces the fraction rule. The CPU's decoder is given no block budget
   (pool/process.py: a budgeted decoder is 4,096 positions wide, slow to attend on the CPU); its rows still follow.
3. Blocks = cache bytes // bytes per block (K and V of `block_tokens` positions in every layer: 2 x layers x
   block_tokens x kv_heads x head_dim x dtype bytes, `PagedKvCache.bytes_per_block`).
4. Rows decoded at once ("auto"): as many as the blocks cover at `LORAPLEX_SAMPLER_ROW_TOKENS` (prompt + new tokens
   a row is expected to hold, default 256: settings.py says why) each, at most `ROWS_CEILING` (1,024) on CUDA and `CPU_ROWS_CEILING` (32) on
   the CPU (a CPU decode step's time grows with its rows: past ~32 tiny-model rows one step outlasts a sampling
   slice, and a training tenant would wait a whole step), rounded down to a multiple of 8 past 8. Rows that turn
   out longer than expected are not refused: the allocator admits a row only with its worst case reserved, so rows
   wait for blocks instead. An integer `LORAPLEX_SAMPLER_MAX_ROWS` forces the rows (the blocks stay as computed).
A cache too small for one row of the expected length is a configuration error naming the settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.errors import InvalidRequestError

BLOCK_TOKENS = 16  # positions per KV block (workers/sampling/kv_blocks.py's block size)
ROWS_CEILING = 1024  # rows one decode step takes at most on a GPU
CPU_ROWS_CEILING = 32  # rows one decode step takes at most on the CPU
CPU_KV_BYTES = 64 * 2**20  # the CPU's cache when no byte budget is configured
ROW_ALIGN = 8  # rows past this are a multiple of it (tensor-core friendly shapes)


@dataclass(frozen=True)
class KvShape:
    """What one cached position costs: the model's decoder layers, KV heads, head size and the cache's dtype bytes."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def of(cls, config: Any, dtype_bytes: int) -> KvShape:
        """The shape of a transformers model config's KV cache (head_dim, else hidden_size / attention heads)."""
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(int(config.num_hidden_layers), int(config.num_key_value_heads), head_dim, dtype_bytes)

    def bytes_per_block(self, block_tokens: int = BLOCK_TOKENS) -> int:
        """K and V of `block_tokens` positions in every layer (equal to PagedKvCache.bytes_per_block)."""
        return 2 * self.layers * block_tokens * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class KvBudget:
    """The decision: `blocks` of `block_tokens` positions (`cache_bytes` in all) and `rows` decoded at once."""

    rows: int
    blocks: int
    block_tokens: int
    bytes_per_block: int
    free_bytes: int | None  # the device memory it was sized from (None: a configured byte budget)
    rows_forced: bool  # rows came from an integer LORAPLEX_SAMPLER_MAX_ROWS

    @property
    def cache_bytes(self) -> int:
        return self.blocks * self.bytes_per_block

    def describe(self) -> str:
        source = "configured bytes" if self.free_bytes is None else f"{self.free_bytes / 2**30:.2f} GiB free"
        rows = "forced" if self.rows_forced else "auto"
        return (f"{self.rows} rows ({rows}), {self.blocks} KV blocks of {self.block_tokens} positions, "
                f"{self.cache_bytes / 2**20:.1f} MiB ({self.bytes_per_block} B a block; from {source})")  # fmt: skip


def blocks_per_row(row_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return -(-row_tokens // block_tokens)


def cache_bytes(
    free_bytes: int | None, fraction: float, configured_bytes: int | None, reserve_bytes: int = 0
) -> int:
    """Bytes for the cache (rules 1-2 of the module doc): `configured_bytes` when given (the CPU's, or an operator's
    override); else min(fraction x free_bytes, free_bytes - reserve_bytes), never below 0."""
    if configured_bytes is not None:
        if configured_bytes < 0:
            raise InvalidRequestError(f"LORAPLEX_SAMPLER_KV_BYTES must be at least 0, got {configured_bytes}")
        return configured_bytes
    if free_bytes is None:
        raise InvalidRequestError("no free device memory to size the KV cache from: set LORAPLEX_SAMPLER_KV_BYTES")
    if not 0 < fraction < 1:
        raise InvalidRequestError(f"LORAPLEX_SAMPLER_KV_MEMORY_FRACTION must be in (0, 1), got {fraction}")
    return max(0, min(int(fraction * free_bytes), free_bytes - reserve_bytes))


def plan_kv_budget(
    shape: KvShape,
    *,
    free_bytes: int | None,
    fraction: float = 0.25,
    configured_bytes: int | None = None,
    reserve_bytes: int = 0,
    row_tokens: int = 256,
    forced_rows: int | None = None,
    ceiling: int = ROWS_CEILING,
    block_tokens: int = BLOCK_TOKENS,
) -> KvBudget:
    """The blocks and rows for this model and memory (the module doc's rule). `free_bytes`: the device's free memory
    (None on the CPU, where `configured_bytes` must be given); `forced_rows`: an integer LORAPLEX_SAMPLER_MAX_ROWS."""
    if row_tokens < 1:
        raise InvalidRequestError(f"LORAPLEX_SAMPLER_ROW_TOKENS must be at least 1, got {row_tokens}")
    if forced_rows is not None and forced_rows < 1:
        raise InvalidRequestError(f"LORAPLEX_SAMPLER_MAX_ROWS must be 'auto' or at least 1, got {forced_rows}")
    per_block = shape.bytes_per_block(block_tokens)
    if per_block <= 0:
        raise InvalidRequestError(f"a KV block of {shape} takes no memory")
    blocks = cache_bytes(free_bytes, fraction, configured_bytes, reserve_bytes) // per_block
    per_row = blocks_per_row(row_tokens, block_tokens)
    fit = min(ceiling, blocks // per_row)
    if fit < 1:
        raise InvalidRequestError(
            f"the sampler's KV cache ({blocks} blocks of {per_block} B) holds no row of {row_tokens} tokens "
            f"({per_row} blocks): raise LORAPLEX_SAMPLER_KV_MEMORY_FRACTION or LORAPLEX_SAMPLER_KV_BYTES, or lower "
            "LORAPLEX_SAMPLER_ROW_TOKENS"
        )
    rows = fit - fit % ROW_ALIGN if fit >= ROW_ALIGN else fit
    if forced_rows is not None:
        rows = forced_rows
    return KvBudget(rows=rows, blocks=blocks, block_tokens=block_tokens, bytes_per_block=per_block,
                    free_bytes=None if configured_bytes is not None else free_bytes,
                    rows_forced=forced_rows is not None)  # fmt: skip
