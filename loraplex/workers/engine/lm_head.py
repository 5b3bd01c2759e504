"""The memory-lean loss front end (DESIGN.md, key technical choice 6): the LM head + log-softmax, chunked over tokens,
giving each real token's target logprob without ever materialising fp32 logits for the whole batch. The losses
(losses.py) are computed from its output."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK_TOKENS = 1024  # rows per chunk: one chunk's [chunk, V] fp32 logits alive at a time


def _target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)


def target_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
    fused: bool = False,
) -> torch.Tensor:
    """log_softmax(hidden @ W^T)[i, targets[i]] in fp32, one chunk of rows at a time.

    hidden: [N, H] (final-norm output), head_weight: [V, H], targets: [N] -> [N] fp32. Each chunk's logits are recomputed in
    the backward (torch.utils.checkpoint), so at most one chunk's [chunk, V] logits is alive in forward and in backward (backward recomputes a
    chunk's logits, uses them and frees them before the next chunk): never [N, V]. Checked in test_engine_chunked_loss.

    fused (CUDA, where triton is, frozen head): each chunk's log-softmax as two Triton kernels over the logits in their
    own dtype, no fp32 [chunk, V] (workers/kernels/triton_lm_head.py; the same maths, this module's function the reference)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    pieces = []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
    fused_chunk = _fused_chunk() if fused and hidden.is_cuda and not head_weight.requires_grad else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if fused_chunk is not None:
            pieces.append(fused_chunk(h, head_weight, t))
        elif grad:
            pieces.append(checkpoint(_target_logprobs, h, head_weight, t, use_reentrant=False))
        else:
            pieces.append(_target_logprobs(h, head_weight, t))
    if not pieces:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(pieces)


def _fused_chunk() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from loraplex.workers.kernels.triton_lm_head import target_logprobs_chunk
    except ImportError:  # no triton (the CPU venv)
        return None
    return target_logprobs_chunk
