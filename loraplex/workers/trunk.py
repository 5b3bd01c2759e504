"""The model's trunk as one module: decoder body -> real (unpadded) rows -> chunked LM-head target logprobs.

One module, so that under FSDP2 (workers/distributed.py) it is the single root unit whose forward all-gathers the
embeddings, final norm and LM head, and whose backward reshards them; the decoder layers are units of their own.
With one rank it is a plain module and computes exactly what the engine computed inline before.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from loraplex.workers.lm_head import target_logprobs


class Trunk(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body  # embeddings -> decoder layers -> final norm (the HF model's get_decoder())
        self.head = head  # the LM head; only its weight is read (chunked log-softmax, no full fp32 logits)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        real_rows: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
    ) -> torch.Tensor:
        """tokens, positions: int64 [B, T]; real_rows: int64 [N] indices into the flattened [B*T] rows; targets: int64
        [N] -> fp32 [N] target logprobs of the real rows."""
        hidden = self.body(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, real_rows)
        return target_logprobs(hidden, cast(torch.Tensor, self.head.weight), targets, chunk_tokens)
