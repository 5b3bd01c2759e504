"""The native sampler's live decode batch: one KV cache (transformers' DynamicCache) whose rows are LEFT padded, so
every row's next token is written into the same column, and rows can leave and join between decode steps.

Layout: per layer keys / values [B, H, T, D]; row b's `lengths[b]` cached tokens sit in the last lengths[b] columns
(columns before them are zero and masked out). A decode step feeds one token per row at position lengths[b] with the 2D
attention mask `column >= T - lengths[b]` over T + 1 columns (HF builds the causal + padding mask from it), and the
cache grows by one column for every row.

`rebuild(keep, joiners, order)` is the only place rows move: it keeps the listed rows, appends the joiners' prompt KV
(right-aligned), puts the rows in `order` (the sampler orders them contiguous per adapter, for the LoRA routing) and
drops leading columns no row needs any more. It runs only when the batch's membership changes; between changes the
cache is the model's own DynamicCache growing step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

# One layer's (keys, values) for one sequence: [H, L, D] each.
LayerKV = tuple[torch.Tensor, torch.Tensor]


def cache_layers(cache: DynamicCache) -> list[LayerKV]:
    """Per layer (keys, values) [B, H, T, D] of a DynamicCache (its full-attention layers' public attributes)."""
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


class DecodeCache:
    def __init__(self, config: Any, device: torch.device) -> None:
        self.config = config  # the model's config: DynamicCache builds its layers from it
        self.device = device
        self.cache: DynamicCache | None = None
        self.lengths = torch.zeros(0, dtype=torch.int64, device=device)  # cached tokens per row
        self.width = 0  # T: columns in the cache

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    def layers(self) -> list[LayerKV]:
        return [] if self.cache is None else cache_layers(self.cache)

    def rebuild(
        self,
        keep: Sequence[int],
        joiners: Sequence[Sequence[LayerKV]],
        order: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """New batch = [kept rows (in the given order of `keep`), then the joiners], permuted by `order` (new row i is
        that list's row order[i]). `lengths`: each new row's cached token count, in the new (permuted) order; a
        joiner's is its prompt length L (its KV is [H, L, D] per layer)."""
        n_keep, n_rows = len(keep), len(keep) + len(joiners)
        if sorted(order) != list(range(n_rows)) or len(lengths) != n_rows:
            raise ValueError("order must be a permutation of the kept rows and joiners, with one length per row")
        if n_rows == 0:
            self.cache, self.width = None, 0
            self.lengths = torch.zeros(0, dtype=torch.int64, device=self.device)
            return
        width = max(int(n) for n in lengths)
        dest = [0] * n_rows  # where the (kept + joiners) list's row j lands
        for new_index, j in enumerate(order):
            dest[j] = new_index
        old = self.layers()
        template = old[0][0] if old else joiners[0][0][0]
        num_layers = len(old) if old else len(joiners[0])
        heads, head_dim = template.shape[-3], template.shape[-1]
        keep_idx = torch.tensor(list(keep), dtype=torch.int64, device=self.device)
        keep_dest = torch.tensor(dest[:n_keep], dtype=torch.int64, device=self.device)
        data: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(num_layers):
            pair = []
            for which in (0, 1):
                new = torch.zeros(n_rows, heads, width, head_dim, dtype=template.dtype, device=self.device)
                if n_keep:
                    src = old[layer][which]
                    w = min(self.width, width)  # kept rows' data lies in the last w columns of both
                    block = src.index_select(0, keep_idx)[:, :, self.width - w :]
                    new[:, :, width - w :].index_copy_(0, keep_dest, block)
                for j, kv in enumerate(joiners):
                    part = kv[layer][which]
                    new[dest[n_keep + j], :, width - part.shape[-2] :] = part
                pair.append(new)
            data.append((pair[0], pair[1]))
        self.cache = DynamicCache(ddp_cache_data=data, config=self.config)
        self.width = width
        self.lengths = torch.tensor([int(n) for n in lengths], dtype=torch.int64, device=self.device)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask bool [B, T + 1], position_ids int64 [B, 1]) for one decode step."""
        columns = torch.arange(self.width + 1, device=self.device)
        mask = columns[None, :] >= (self.width - self.lengths)[:, None]
        return mask, self.lengths.view(-1, 1)

    def advance(self) -> None:
        """After a decode step: every row cached one more token."""
        self.lengths = self.lengths + 1
        self.width += 1
