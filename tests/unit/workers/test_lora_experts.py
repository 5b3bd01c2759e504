"""Expert LoRA (workers/lora/experts.py) on the CPU in fp32: the reference is transformers' own experts forward when the
adapters are zero and the merged-weights model when they are not (so expert LoRA is scaled by the routing weights, as
documented), and the grouped fast path equals the reference on random inputs, outputs and gradients, with several
adapters of different ranks, experts no token picks, and the LoRA products in chunks of groups past
grouped_mm's group limit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from loraplex.workers.lora import Routing
from loraplex.workers.lora.experts import ExpertBanks, bank_gradients_discarded, experts_grouped, experts_reference

E, H, INTER, K, S, R = 6, 16, 12, 2, 4, 8


def _block(seed: int) -> tuple[Qwen3MoeExperts, Qwen3MoeTopKRouter]:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=True)  # fmt: skip
    experts, router = Qwen3MoeExperts(config), Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj, router.weight):
            p.normal_(0, 0.3)
    return experts, router


def _banks(seed: int, ranks: list[int], zero: bool = False) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    shapes = [(H, INTER), (H, INTER), (INTER, H)]  # gate, up, down: (in, out)
    tensors = []
    for n_in, n_out in shapes:
        a = torch.zeros(S, E, n_in, R)
        b = torch.zeros(S, E, R, n_out)
        if not zero:
            for s, r in enumerate(ranks):  # rank padding stays zero (the slot-bank invariant)
                a[s, :, :, :r] = torch.randn(E, n_in, r, generator=g) * 0.3
                b[s, :, :r] = torch.randn(E, r, n_out, generator=g) * 0.3
        tensors += [a.requires_grad_(), b.requires_grad_()]
    return ExpertBanks(*tensors)


def _inputs(n: int, router: Qwen3MoeTopKRouter, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    with torch.no_grad():
        _, weights, idx = router(x)
    return x, idx, weights


def test_zero_adapters_are_transformers_experts_forward() -> None:
    experts, router = _block(0)
    x, idx, weights = _inputs(20, router, 1)
    routing = Routing.build([2, 0], [4, 8], [2.0, 0.5], [12, 8])
    want = experts(x, idx, weights)
    for op in (experts_reference, experts_grouped):
        got = op(
            x, idx, weights, experts.gate_up_proj, experts.down_proj, _banks(0, [8] * S, zero=True), routing, F.silu
        )
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_one_adapter_is_the_merged_expert_weights_scaled_by_the_routing_weights() -> None:
    experts, router = _block(1)
    x, idx, weights = _inputs(15, router, 2)
    banks = _banks(3, [5, 8, 3, 8])
    slot, rank, scale = 1, 8, 0.75
    routing = Routing.build([slot], [rank], [scale], [15])
    got = experts_reference(x, idx, weights, experts.gate_up_proj, experts.down_proj, banks, routing, F.silu)
    merged, _ = _block(1)
    with torch.no_grad():
        (ga, gb), (ua, ub), (da, db) = ((a[slot, :, :, :rank], b[slot, :, :rank]) for a, b in banks.pairs())  # type: ignore[index]
        delta_gate_up = torch.cat([ga @ gb, ua @ ub], dim=-1).transpose(1, 2)  # [E, 2I, H]
        merged.gate_up_proj += scale * delta_gate_up
        merged.down_proj += scale * (da @ db).transpose(1, 2)
    torch.testing.assert_close(got, merged(x, idx, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_groups", [1023, 5, 1])
def test_grouped_equals_the_reference_outputs_and_gradients(max_groups: int) -> None:
    experts, router = _block(2)
    x, idx, weights = _inputs(40, router, 3)
    idx = torch.where(idx == 3, 4, idx)  # expert 3 picked by no token: empty groups
    ranks = [2, 8, 5, 1]
    banks = _banks(4, ranks)
    routing = Routing.build([3, 0, 2], [ranks[3], ranks[0], ranks[2]], [4.0, 1.0, 0.4], [9, 0, 31])  # an empty group
    args = (experts.gate_up_proj, experts.down_proj, banks, routing, F.silu)
    want = experts_reference(x, idx, weights, *args)
    got = experts_grouped(x, idx, weights, *args, max_groups=max_groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    leaves = (x, *(t for pair in banks.pairs() for t in pair if t is not None))
    grads_want = torch.autograd.grad(want, leaves, dy)
    grads_got = torch.autograd.grad(got, leaves, dy)
    for w, g in zip(grads_want, grads_got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # slots no group uses get no gradient, and rank padding gets exact zeros
    bank_grads = grads_got[1:]
    assert all(float(t[1].abs().max()) == 0.0 for t in bank_grads)
    assert float(bank_grads[0][3, :, :, ranks[3] :].abs().max()) == 0.0


@pytest.mark.parametrize("max_groups", [1023, 5])
def test_with_a_trigger_the_backward_asked_for_the_trigger_alone_fills_the_banks_grad_in_place(max_groups: int) -> None:
    """The engine's fused path (and a CUDA graph's captured backward): gradients asked for the microbatch's trigger
    only still reach every bank's .grad, added in place to what it held, equal to autograd's; slots may repeat (a
    graph's pad group: its rows have scale 0)."""
    experts, router = _block(5)
    x, idx, weights = _inputs(30, router, 6)
    ranks = [3, 8, 6, 2]
    banks = _banks(7, ranks)
    routing = Routing.build([2, 1, 1], [6, 8, 8], [0.5, 2.0, 0.0], [11, 14, 5])  # the last group: pad rows, scale 0
    args = (experts.gate_up_proj, experts.down_proj, banks, routing, F.silu)
    dy = torch.randn(30, H, generator=torch.Generator().manual_seed(8))
    masters = [t for pair in banks.pairs() for t in pair if t is not None]
    want = torch.autograd.grad(experts_reference(x.detach(), idx, weights, *args), masters, dy)
    held = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)) for t in masters]
    for t, h in zip(masters, held, strict=True):
        t.grad = h.clone()
    trigger = torch.zeros((), requires_grad=True)
    out = experts_grouped(x.detach(), idx, weights, *args, max_groups=max_groups, trigger=trigger)
    torch.testing.assert_close(out, experts_reference(x.detach(), idx, weights, *args), rtol=1e-5, atol=1e-5)
    torch.autograd.grad(out, trigger, dy, allow_unused=True)
    for t, h, w in zip(masters, held, want, strict=True):
        assert t.grad is not None
        torch.testing.assert_close(t.grad - h, w, rtol=1e-5, atol=1e-5)


def test_a_warm_up_backward_adds_nothing_to_the_banks_grad_even_from_non_finite_activations() -> None:
    """A CUDA graph's warm-up runs placeholder inputs through the body (slot 0) with a zero gradient; within
    `bank_gradients_discarded` the masters' .grad keeps what it held, though activations that are not finite make that
    zero gradient NaN; outside it, the same backward poisons slot 0's gradient (the failure this guards)."""
    experts, router = _block(5)
    x, idx, weights = _inputs(12, router, 6)
    x = x.detach().clone()
    x[3] = float("inf")
    banks = _banks(7, [3, 8, 6, 2])
    routing = Routing.build([0], [R], [0.0], [12])  # body_graphs' placeholder routing: one group, slot 0, scale 0
    masters = [t for pair in banks.pairs() for t in pair if t is not None]
    held = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)) for t in masters]

    def warm_up_backward() -> None:
        for t, h in zip(masters, held, strict=True):
            t.grad = h.clone()
        trigger = torch.zeros((), requires_grad=True)
        out = experts_grouped(x, idx, weights, experts.gate_up_proj, experts.down_proj, banks, routing, F.silu,
                              trigger=trigger)  # fmt: skip
        torch.autograd.grad(out, trigger, torch.zeros_like(out), allow_unused=True)

    with bank_gradients_discarded():
        warm_up_backward()
    for t, h in zip(masters, held, strict=True):
        assert t.grad is not None and torch.equal(t.grad, h)
    warm_up_backward()
    assert any(not torch.isfinite(t.grad[0]).all() for t in masters if t.grad is not None)


def test_the_grouped_path_reads_only_the_routings_device_tensors() -> None:
    """A CUDA graph replays the expert LoRA on a static routing whose host fields are those of its capture and whose
    device tensors (offs, row_scales, slot_ids) each microbatch's routing is copied into: the output is the same."""
    experts, router = _block(7)
    x, idx, weights = _inputs(24, router, 8)
    banks = _banks(9, [4, 8, 2, 6])
    real = Routing.build([3, 1, 0, 0], [6, 8, 4, 4], [0.5, 2.0, 0.0, 0.0], [10, 9, 5, 0])  # pad rows, an empty group
    static = Routing.build([0] * 4, [R] * 4, [0.0] * 4, [24, 0, 0, 0])
    for name in ("offs", "row_scales", "slot_ids"):
        getattr(static, name).copy_(getattr(real, name))
    args = (x, idx, weights, experts.gate_up_proj, experts.down_proj, banks)
    torch.testing.assert_close(experts_grouped(*args, static, F.silu), experts_grouped(*args, real, F.silu),
                               rtol=0, atol=0)  # fmt: skip


def test_a_bank_without_a_grad_buffer_is_refused_when_read_for_training() -> None:
    experts, router = _block(6)
    x, idx, weights = _inputs(4, router, 7)
    routing = Routing.build([0], [8], [1.0], [4])
    with pytest.raises(ValueError, match=r"needs its \.grad buffer"):
        experts_grouped(x, idx, weights, experts.gate_up_proj, experts.down_proj, _banks(0, [8] * S), routing, F.silu,
                        trigger=torch.zeros((), requires_grad=True))  # fmt: skip


def test_bad_shapes_are_refused() -> None:
    experts, router = _block(3)
    x, idx, weights = _inputs(6, router, 4)
    routing = Routing.build([0], [8], [1.0], [5])
    with pytest.raises(ValueError, match="routing covers 5 rows"):
        experts_grouped(x, idx, weights, experts.gate_up_proj, experts.down_proj, _banks(0, [8] * S), routing, F.silu)


def test_a_projection_without_banks_gets_no_lora() -> None:
    experts, router = _block(4)
    x, idx, weights = _inputs(12, router, 6)
    full = _banks(7, [3, 8, 8, 8])
    no_up = ExpertBanks(full.gate_a, full.gate_b, None, None, full.down_a, full.down_b)
    zero_up = ExpertBanks(full.gate_a, full.gate_b, torch.zeros_like(full.up_a), torch.zeros_like(full.up_b),  # type: ignore[arg-type]
                          full.down_a, full.down_b)  # fmt: skip
    routing = Routing.build([0, 2], [3, 8], [1.0, 2.0], [5, 7])
    args = (experts.gate_up_proj, experts.down_proj)
    for op in (experts_reference, experts_grouped):
        torch.testing.assert_close(
            op(x, idx, weights, *args, no_up, routing, F.silu), op(x, idx, weights, *args, zero_up, routing, F.silu)
        )
