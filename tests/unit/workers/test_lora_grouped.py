"""The grouped_mm LoRA op against the plain-torch reference (the oracle): outputs, x.grad, A-bank and B-bank grads for 1..6
groups with different slots, ranks and scales, uneven and empty groups; grouped_mm's sharp edges (zero-stride gradients,
unaligned dims, uncovered rows); exact rank padding; op selection; and the whole engine with either op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.workers.lora import Routing, lora_delta_grouped, lora_delta_reference, select_lora_op
from loraplex.workers.lora.slot_bank import LoraOp
from tests.helpers.datums import with_datums
from tests.helpers.lora import (
    ADAPTERS,
    CASES,
    SLOTS,
    check_against_fp32_reference,
    make_banks,
    make_data,
    make_engine,
    run_op,
)


def assert_same_as_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, routing: Routing, grad: torch.Tensor | None, tol: float = 1e-5
) -> tuple[torch.Tensor, ...]:
    got = run_op(lora_delta_grouped, x, a, b, routing, grad)
    want = run_op(lora_delta_reference, x, a, b, routing, grad)
    for name, g, w in zip(("delta", "x.grad", "A grad", "B grad"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")
    return got


@pytest.mark.parametrize("groups", sorted(CASES))
@pytest.mark.parametrize("zero_stride_grad", [False, True], ids=["random-grad", "y.sum"])
def test_grouped_matches_reference(groups: int, zero_stride_grad: bool) -> None:
    slots, ranks, scales, rows = CASES[groups]
    n_in, n_out, r_max = 24, 40, 8
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), n_in, n_out, r_max, seed=groups)
    routing = Routing.build(slots, ranks, scales, rows)
    g = torch.Generator().manual_seed(100 + groups)
    x = torch.randn(routing.num_rows, n_in, generator=g)
    grad = None if zero_stride_grad else torch.randn(routing.num_rows, n_out, generator=g)
    _, _, grad_a, grad_b = assert_same_as_reference(x, a, b, routing, grad)
    # Gradients land only in the groups' slots, and only in their real-rank parts: exactly zero elsewhere.
    used = {s: r for s, r, n in zip(slots, ranks, rows, strict=True)}
    for slot in range(SLOTS):
        rank = used.get(slot, 0)
        assert torch.count_nonzero(grad_a[slot, :, rank:]) == 0 and torch.count_nonzero(grad_b[slot, rank:]) == 0
    active = [s for s, n in zip(slots, rows, strict=True) if n > 0]
    assert all(grad_b[s].abs().sum() > 0 for s in active)


def test_empty_groups_get_zero_gradient_and_contribute_nothing() -> None:
    slots, ranks, scales, rows = [2, 5, 6], [4, 4, 4], [1.0, 1.0, 1.0], [0, 10, 0]  # the only rows: middle group
    a, b = make_banks(dict.fromkeys(slots, 4), 16, 16, 4, seed=7)
    routing = Routing.build(slots, ranks, scales, rows)
    x = torch.randn(10, 16)
    delta, _, grad_a, grad_b = assert_same_as_reference(x, a, b, routing, torch.randn(10, 16))
    torch.testing.assert_close(delta, x @ a[5] @ b[5], atol=1e-5, rtol=1e-5)
    for slot in (2, 6):
        assert torch.count_nonzero(grad_a[slot]) == 0 and torch.count_nonzero(grad_b[slot]) == 0


def test_rank_padding_is_exact_against_an_r_max_equal_rank_bank() -> None:
    """Rank-3 adapters in an r_max-8 bank give what the same adapters give in an r_max-3 bank (which itself needs padding
    to 4 for grouped_mm's 16-byte strides), and their padded gradients are exact zeros."""
    slots, ranks, scales, rows = [1, 4, 6], [3, 3, 3], [2.0, 0.5, 1.0], [9, 14, 5]
    narrow_a, narrow_b = make_banks(dict.fromkeys(slots, 3), 20, 12, 3, seed=11)
    wide_a, wide_b = torch.zeros(SLOTS, 20, 8), torch.zeros(SLOTS, 8, 12)
    wide_a[:, :, :3], wide_b[:, :3] = narrow_a, narrow_b
    routing = Routing.build(slots, ranks, scales, rows)
    x, grad = torch.randn(28, 20), torch.randn(28, 12)
    narrow = assert_same_as_reference(x, narrow_a, narrow_b, routing, grad)
    wide = assert_same_as_reference(x, wide_a, wide_b, routing, grad)
    torch.testing.assert_close(wide[0], narrow[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(wide[1], narrow[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(wide[2][:, :, :3], narrow[2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(wide[3][:, :3], narrow[3], atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(wide[2][:, :, 3:]) == 0 and torch.count_nonzero(wide[3][:, 3:]) == 0


@pytest.mark.parametrize(("n_in", "n_out", "r_max"), [(6, 5, 3), (13, 8, 5), (8, 7, 4), (9, 12, 8)])
def test_unaligned_dims_are_padded_exactly(n_in: int, n_out: int, r_max: int) -> None:
    slots, ranks, scales, rows = [0, 3, 2], [r_max, 1, min(2, r_max)], [1.0, 3.0, 0.5], [4, 7, 3]
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), n_in, n_out, r_max, seed=n_in)
    routing = Routing.build(slots, ranks, scales, rows)
    assert_same_as_reference(torch.randn(14, n_in), a, b, routing, None)
    assert_same_as_reference(torch.randn(14, n_in), a, b, routing, torch.randn(14, n_out))


def test_non_contiguous_and_offset_inputs() -> None:
    slots, ranks, scales, rows = [1, 2], [4, 8], [1.0, 2.0], [5, 6]
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), 16, 8, 8, seed=3)
    routing = Routing.build(slots, ranks, scales, rows)
    base = torch.randn(16, 12)
    x_t = base.t()  # [12, 16]: column-major view, not contiguous
    x_off = torch.randn(12 * 16 + 1)[1:].view(12, 16)[1:]  # contiguous, base pointer 4 bytes off 16-byte alignment
    for x in (x_t[:11], x_off):
        got = lora_delta_grouped(x, a, b, routing)
        torch.testing.assert_close(got, lora_delta_reference(x, a, b, routing), atol=1e-5, rtol=1e-5)


def test_partial_requires_grad_and_no_grad() -> None:
    slots, ranks, scales, rows = [0, 5], [8, 2], [0.5, 4.0], [3, 9]
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), 8, 16, 8, seed=5)
    routing = Routing.build(slots, ranks, scales, rows)
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(7))  # the first layer's input: frozen embeddings, no grad
    results = []
    for op in (lora_delta_grouped, lora_delta_reference):
        bank_a, bank_b = a.clone().requires_grad_(), b.clone().requires_grad_()
        op(x, bank_a, bank_b, routing).square().sum().backward()
        results.append((bank_a.grad, bank_b.grad))
    for g, w in zip(*results, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # forward-only passes
        torch.testing.assert_close(
            lora_delta_grouped(x, a, b, routing), lora_delta_reference(x, a, b, routing), atol=1e-5, rtol=1e-5
        )


def test_routing_must_cover_every_row_and_row_scales_are_built_once() -> None:
    routing = Routing.build([3, 1, 2], [4, 2, 8], [0.5, 2.0, 1.25], [2, 0, 3])
    torch.testing.assert_close(routing.row_scales, torch.tensor([[0.5], [0.5], [1.25], [1.25], [1.25]]))
    assert routing.row_scales.dtype == torch.float32 and routing.offs.dtype == torch.int32
    a, b = make_banks({3: 4, 1: 2, 2: 8}, 8, 8, 8, seed=0)
    with pytest.raises(ValueError, match="covers 5 rows"):
        lora_delta_grouped(torch.randn(6, 8), a, b, routing)  # a row past offs[-1] would come back as garbage
    with pytest.raises(ValueError):
        Routing.build([0, 1], [4, 4], [1.0, 1.0], [3, -1])


def test_bf16_on_cpu_stays_within_the_bf16_rounding_bound() -> None:
    """The bound the GPU tests use, checked on CPU's bf16 grouped_mm: outputs and all gradients."""
    slots, ranks, scales, rows = [2, 0, 5, 7], [16, 8, 3, 16], [2.0, 0.5, 4.0, 1.0], [40, 7, 0, 33]
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), 64, 48, 16, seed=9)
    routing = Routing.build(slots, ranks, scales, rows)
    ratios = check_against_fp32_reference(torch.randn(80, 64), a, b, routing, torch.randn(80, 48), torch.bfloat16)
    assert max(ratios.values()) < 1


def test_select_lora_op(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_lora_op("cpu", torch.float32) is lora_delta_grouped  # measured faster on CPU (see ops.py)
    assert select_lora_op("cpu", torch.bfloat16) is lora_delta_grouped
    assert select_lora_op("cpu", torch.float64) is lora_delta_reference  # grouped_mm has no fp64
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, dtype, expected in [
        ((9, 0), torch.bfloat16, lora_delta_grouped),
        ((10, 0), torch.bfloat16, lora_delta_grouped),
        ((9, 0), torch.float32, lora_delta_reference),
        ((8, 0), torch.bfloat16, lora_delta_reference),  # no fused kernel: torch loops and syncs
        ((12, 0), torch.bfloat16, lora_delta_reference),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert select_lora_op("cuda:0", dtype) is expected, (capability, dtype)


# ---- the whole engine ------------------------------------------------------------------------------------------------
# One microbatch of all 4 adapters (4 groups); or token-capped microbatches of 1-3 groups with r_max 6 (padded to 8).
# op None: the engine's default fused path (grouped_mm for several groups); lora_delta_grouped: the per-layer grouped op.
@pytest.mark.parametrize("op", [None, lora_delta_grouped], ids=["fused", "grouped-op"])
@pytest.mark.parametrize(("max_rank", "microbatch_tokens"), [(8, 4096), (6, 40)])
def test_engine_with_grouped_op_equals_engine_with_reference_op(
    tiny_dir: Path, max_rank: int, microbatch_tokens: int, op: LoraOp | None
) -> None:
    grouped, reference = (
        make_engine(tiny_dir, max_rank, microbatch_tokens, lora_op=o) for o in (op, lora_delta_reference)
    )
    assert all(bank.op is lora_delta_grouped for bank in grouped.banks.values())  # the CPU default
    assert grouped.fused_lora == (op is None) and not reference.fused_lora
    items = [
        ("b", make_data(1, [9, 4]), "cross_entropy", None, False),
        ("a", make_data(2, [5, 11, 3]), "cross_entropy", None, False),
        ("d", make_data(3, [7]), "cross_entropy", None, False),
        ("c", make_data(4, [6, 2, 8]), "cross_entropy", None, False),
        ("a", make_data(5, [4]), "cross_entropy", None, True),  # forward-only rows in the same batch
    ]
    for _ in range(2):
        outs = [e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in (grouped, reference)]
        for got, want in zip(*outs, strict=True):
            assert got["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], abs=1e-4, rel=1e-5)
            for dg, dw in zip(got["loss_fn_outputs"], want["loss_fn_outputs"], strict=True):
                torch.testing.assert_close(
                    torch.tensor(dg["logprobs"]), torch.tensor(dw["logprobs"]), atol=1e-5, rtol=0
                )
        for model_id, *_ in ADAPTERS:
            for name, (ga, gb) in grouped.adapter_grads(model_id).items():
                ra, rb = reference.adapter_grads(model_id)[name]
                torch.testing.assert_close(ga, ra, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(gb, rb, atol=1e-5, rtol=1e-4)
        steps = [("a", {"learning_rate": 1e-2}), ("b", {"learning_rate": 5e-3, "weight_decay": 0.1})]
        steps += [("c", {"learning_rate": 2e-2, "grad_clip_norm": 0.5}), ("d", {"learning_rate": 1e-2})]
        for engine in (grouped, reference):
            assert all("metrics" in r for r in engine.optim_step(steps))
    for model_id, *_ in ADAPTERS:
        for name, (wa, wb) in grouped.adapter_weights(model_id).items():
            ra, rb = reference.adapter_weights(model_id)[name]
            torch.testing.assert_close(wa, ra, atol=1e-5, rtol=0)
            torch.testing.assert_close(wb, rb, atol=1e-5, rtol=0)
    for engine in (grouped, reference):  # the padding beyond each adapter's rank stayed exactly zero
        for model_id, *_ in ADAPTERS:
            r = engine.adapter(model_id)
            for bank in engine.banks.values():
                assert torch.count_nonzero(bank.lora_A[r.slot, :, r.rank :]) == 0
                assert torch.count_nonzero(bank.lora_B[r.slot, r.rank :]) == 0
