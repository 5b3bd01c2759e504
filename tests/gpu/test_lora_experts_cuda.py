"""Expert LoRA's grouped path (workers/lora/experts.py) on CUDA in bf16 against the fp32 reference loop: outputs and
gradients within 2x the bf16 reference loop's own error (+ a bf16 ulp of the largest value), at a Qwen3-30B-A3B-like
width (hidden 2048, expert width 768, rank 16; 16 experts, top-4), with 3 adapter groups, one of them empty, and the
LoRA products cut into expert blocks (a group limit below E x G)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.workers.lora import Routing
from loraplex.workers.lora.experts import ExpertBanks, experts_grouped, experts_reference

CUDA = torch.device("cuda")
E, H, INTER, K, S, R = 16, 2048, 768, 4, 4, 16


@pytest.mark.parametrize("max_groups", [1023, 20])
def test_grouped_experts_bf16_match_the_fp32_reference(max_groups: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(max_groups)
    n = 600
    x32 = torch.randn(n, H, device=CUDA, generator=g)
    gate_up32 = 0.02 * torch.randn(E, 2 * INTER, H, device=CUDA, generator=g)
    down32 = 0.02 * torch.randn(E, H, INTER, device=CUDA, generator=g)
    logits = torch.randn(n, E, device=CUDA, generator=g)
    weights, idx = torch.topk(logits.softmax(-1), K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ranks = [16, 8, 4, 16]
    tensors = []
    for n_in, n_out in ((H, INTER), (H, INTER), (INTER, H)):
        a, b = torch.zeros(S, E, n_in, R, device=CUDA), torch.zeros(S, E, R, n_out, device=CUDA)
        for s, r in enumerate(ranks):
            a[s, :, :, :r] = torch.randn(E, n_in, r, device=CUDA, generator=g) / n_in**0.5
            b[s, :, :r] = 0.05 * torch.randn(E, r, n_out, device=CUDA, generator=g)
        tensors += [a.requires_grad_(), b.requires_grad_()]
    banks = ExpertBanks(*tensors)
    routing = Routing.build([1, 3, 0], [8, 16, 16], [2.0, 1.0, 0.5], [250, 0, 350], CUDA)
    dy = torch.randn(n, H, device=CUDA, generator=g)

    def run(op, dtype, **kw):  # type: ignore[no-untyped-def]
        x = x32.to(dtype).requires_grad_()
        out = op(x, idx, weights.to(dtype), gate_up32.to(dtype), down32.to(dtype), banks, routing, F.silu, **kw)
        grads = torch.autograd.grad(out, (x, *tensors), dy.to(dtype))
        return [out.float(), *(t.float() for t in grads)]

    exact = run(experts_reference, torch.float32)
    ref16 = run(experts_reference, torch.bfloat16)
    fast16 = run(experts_grouped, torch.bfloat16, max_groups=max_groups)
    for f, r, x in zip(fast16, ref16, exact, strict=True):
        e_fast, e_ref = (f - x).abs().max().item(), (r - x).abs().max().item()
        assert e_fast <= 2 * e_ref + 2**-8 * x.abs().max().item(), (e_fast, e_ref)
