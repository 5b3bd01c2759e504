"""The fused LM-head log-softmax (workers/kernels/triton_lm_head.py) on CUDA at Qwen3-4B's head (151,936 x 2,560, bf16)
against the eager chunk it replaces (lm_head._target_logprobs, the same bf16 logits then fp32 maths): target logprobs
within 1e-4 (only the logsumexp's summation order differs), the hidden states' gradient within bf16 rounding of it,
through lm_head.target_logprobs' chunking (a last, shorter chunk)."""

from __future__ import annotations

import pytest
import torch

from loraplex.workers.engine.lm_head import _target_logprobs, target_logprobs

pytest.importorskip("loraplex.workers.kernels.triton_lm_head")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows", [2500, 7])
def test_fused_lm_head_matches_the_eager_chunk(rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = (0.02 * torch.randn(151936, 2560, device=CUDA, generator=g)).to(torch.bfloat16)
    hidden = torch.randn(rows, 2560, device=CUDA, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 151936, (rows,), device=CUDA, generator=g)
    targets[0] = 151935
    dy = torch.randn(rows, device=CUDA, generator=g)
    fused = target_logprobs(hidden, weight, targets, 1024, fused=True)
    eager = torch.cat(
        [_target_logprobs(hidden[i : i + 1024], weight, targets[i : i + 1024]) for i in range(0, rows, 1024)]
    )
    assert fused.dtype == torch.float32 and fused.shape == (rows,)
    assert (fused - eager).abs().max().item() <= 1e-4
    (grad_fused,) = torch.autograd.grad(fused, hidden, dy)
    (grad_eager,) = torch.autograd.grad(eager, hidden, dy)
    scale = grad_eager.float().abs().max().item()
    assert (grad_fused.float() - grad_eager.float()).abs().max().item() <= 2**-7 * scale
