"""The LM head's target logprobs with the log-softmax fused into two Triton kernels (CUDA only).

Per chunk of rows, as `lm_head._target_logprobs` computes it (recomputed in the backward): logits = hidden @ W^T in the
activations' dtype, then in fp32 target logit - logsumexp. The eager chunk writes the fp32 logits ([chunk, V]: 622 MB
for 1,024 rows of Qwen3's 151,936-token vocabulary) and runs several kernels over them each way. Here:
  forward:  the matmul, then one kernel reading the bf16 logits once (online max / sum of exp): lse and target logit
            per row (fp32);
  backward: the matmul again (nothing [chunk, V] is kept between forward and backward: memory as the eager chunk's),
            one kernel turning the logits in place into g * (onehot - softmax) in their dtype (the eager path's fp32
            gradient cast to the matmul's dtype), and the matmul giving the hidden states' gradient.
The head weight is frozen (no gradient for it: refused if it requires one). The plain-torch reference is
`lm_head._target_logprobs`; tests/gpu/test_triton_lm_head_cuda.py compares them.

Imported only where triton is (the GPU image): workers/engine/lm_head.py decides.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 4096  # columns per loop step; the vocabulary size is a compile-time constant (one compile per model)


@triton.jit
def _lse_target(logits_ptr, targets_ptr, lse_ptr, target_ptr, N_COLS: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * N_COLS
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N_COLS, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < N_COLS, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes still at -inf (no column yet) keep a zero sum rather than exp(-inf - -inf) = nan
        s = s * tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new)) + tl.where(
            x == float("-inf"), 0.0, tl.exp(x - m_new)
        )
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max)), axis=0)
    tl.store(lse_ptr + row, row_max + tl.log(total))
    target = tl.load(targets_ptr + row)
    tl.store(target_ptr + row, tl.load(base + target).to(tl.float32))


@triton.jit
def _softmax_grad(logits_ptr, targets_ptr, lse_ptr, g_ptr, N_COLS: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    # d(target logit - lse)/d logit_j = onehot_j - softmax_j, times the row's incoming gradient; written in place
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * N_COLS
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, N_COLS, BLOCK):
        idx = start + cols
        mask = idx < N_COLS
        x = tl.load(base + idx, mask=mask, other=0.0)
        p = tl.exp(x.to(tl.float32) - lse)
        grad = g * (tl.where(idx == target, 1.0, 0.0) - p)
        tl.store(base + idx, grad.to(x.dtype), mask=mask)


class _FusedTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, weight)
        rows, vocab = logits.shape
        lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
        target = torch.empty_like(lse)
        targets = targets.contiguous()
        if rows:
            _lse_target[(rows,)](logits, targets, lse, target, vocab, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(hidden, weight, targets, lse)
        return target - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        logits = F.linear(hidden, weight)
        rows, vocab = logits.shape
        if rows:
            g = grad.float().contiguous()
            _softmax_grad[(rows,)](logits, targets, lse, g, vocab, BLOCK=BLOCK, num_warps=8)
        return logits @ weight, None, None


def target_logprobs_chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(hidden @ W^T)[i, targets[i]] in fp32 for hidden [C, H], W [V, H] (frozen), targets int64 [C]."""
    if weight.requires_grad:
        raise ValueError("the fused LM head computes no weight gradient: the head weight must be frozen")
    return _FusedTargetLogprobs.apply(hidden.contiguous(), weight, targets)
