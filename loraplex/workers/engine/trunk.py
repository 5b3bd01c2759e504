"""The model's trunk as one module: decoder body -> real (unpadded) rows -> chunked LM-head target logprobs.

One module, so that under FSDP2 (workers/ranks/distributed.py) it is the single root unit whose forward all-gathers the
embeddings, final norm and LM head, and whose backward reshards them; the decoder layers are units of their own.
With one rank it is a plain module and computes exactly what the engine computed inline before.

Two layouts (workers/engine/engine.py chooses): padded, [B, T] rows padded on the right, whose real rows are picked out after
the body; packed, one [1, N] row of sequences back to back (every row real), whose boundaries (`cu_seqlens`, the longest
length) go to the packed attention (workers/kernels/packed_attention.py) through the body's forward kwargs.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from loraplex.workers.engine.lm_head import target_logprobs
from loraplex.workers.kernels.packed_attention import packed_forward_kwargs


class Trunk(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body  # embeddings -> decoder layers -> final norm (the HF model's get_decoder())
        self.head = head  # the LM head; only its weight is read (chunked log-softmax, no full fp32 logits)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        real_rows: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_tokens: int,
        cu_seqlens: torch.Tensor | None = None,
        max_length: int | None = None,
        fused_head: bool = False,
        uniform: bool = False,
    ) -> torch.Tensor:
        """tokens: int64 [B, T]; positions: int64 [B, T], or None for 0..T-1 in every row (padded rows: the body's default;
        handing them over would make transformers look for packed sequences in them, a device-to-host sync in every
        microbatch); real_rows: int64 [N] indices into the flattened [B*T] rows (None: all of them); targets: int64
        [N] -> fp32 [N] target logprobs of the real rows.

        Packed: B = 1, positions restart at 0 for each sequence, cu_seqlens int32 [S+1] (on the device) and max_length
        (a host int) describe the sequences; the body's attention must be the packed one (install_packed_attention);
        uniform: every sequence is max_length long (packed_forward_kwargs). fused_head: the LM head's fused
        log-softmax where it can run (lm_head.target_logprobs)."""
        hidden = self.hidden(tokens, positions, cu_seqlens, max_length, uniform)
        if real_rows is not None:
            hidden = hidden.index_select(0, real_rows)
        return target_logprobs(hidden, cast(torch.Tensor, self.head.weight), targets, chunk_tokens, fused_head)

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None = None,
        max_length: int | None = None,
        uniform: bool = False,
    ) -> torch.Tensor:
        """The body alone: the final norm's output [B*T, H] (arguments as `forward`'s). With one rank the engine's
        CUDA graphs capture this (workers/engine/body_graphs.py); under FSDP only `forward` runs (the root unit's hooks)."""
        extra: dict[str, Any] = {}
        if cu_seqlens is not None:
            if max_length is None:
                raise ValueError("a packed forward needs max_length with cu_seqlens")
            extra = packed_forward_kwargs(cast(Any, self.body).config, cu_seqlens, max_length, uniform)
        hidden = self.body(input_ids=tokens, position_ids=positions, use_cache=False, **extra).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])
