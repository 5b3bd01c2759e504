"""The fused per-microbatch LoRA path (lora/fused.py) against the plain-torch reference (the oracle): outputs, x.grad and
the bank gradients for 1..5 groups with mixed ranks (zero padding), empty groups, x with and without grad, zero-stride
incoming gradients, aligned views and unaligned copies, fp32 (1e-5) and bf16 (the bf16 rounding bound); and the whole
engine on the fused path against the engine forced onto the reference op, over 3 training steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.workers.lora import BankLayout, MicrobatchBanks, Routing, lora_delta_fused, lora_delta_reference
from loraplex.workers.lora.gemm import accumulate_matmul, gmm_operand, matmul_into_float
from tests.helpers.datums import with_datums
from tests.helpers.lora import (
    ADAPTERS,
    CASES,
    check_against_fp32_reference,
    make_banks,
    make_data,
    make_engine,
    run_fused,
    run_op,
)

FUSED_CASES = {g: CASES[g] for g in range(1, 6)}  # G = 1..5: uneven, empty groups, mixed ranks in an r_max-8 bank


@pytest.mark.parametrize(
    ("groups", "single"), [(g, True) for g in sorted(FUSED_CASES)] + [(1, False)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-frozen"])
@pytest.mark.parametrize("zero_stride_grad", [False, True], ids=["random-grad", "y.sum"])
def test_fused_matches_reference_fp32(
    groups: int, single: bool, grouped: bool, x_grad: bool, zero_stride_grad: bool
) -> None:
    """single False: one group as a CUDA graph runs it (r_max, the scale on the device); rank 7 in an r_max-8 bank."""
    slots, ranks, scales, rows = FUSED_CASES[groups]
    n_in, n_out, r_max = 24, 40, 8
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), n_in, n_out, r_max, seed=groups)
    routing = Routing.build(slots, ranks, scales, rows)
    g = torch.Generator().manual_seed(100 + groups)
    x = torch.randn(routing.num_rows, n_in, generator=g)
    grad = None if zero_stride_grad else torch.randn(routing.num_rows, n_out, generator=g)
    got = run_fused(x, a, b, routing, grad, grouped=grouped, x_grad=x_grad, single=single)
    want = run_op(lora_delta_reference, x, a, b, routing, grad)
    for name, gv, wv in zip(("delta", "x.grad", "A grad", "B grad"), got, want, strict=True):
        if name == "x.grad" and not x_grad:
            assert gv is None
            continue
        assert gv.shape == wv.shape and gv.dtype == wv.dtype, name
        torch.testing.assert_close(gv, wv, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # Gradients only in the groups' slots and their real-rank parts: exact zeros elsewhere (as the reference).
    used = dict(zip(slots, ranks, strict=True))
    for slot in range(a.shape[0]):
        rank = used.get(slot, 0)
        assert torch.count_nonzero(got[2][slot, :, rank:]) == 0 and torch.count_nonzero(got[3][slot, rank:]) == 0


@pytest.mark.parametrize("lead", [8, 3], ids=["aligned-views", "unaligned-copies"])
@pytest.mark.parametrize("dims", [(24, 40, 8), (20, 12, 6), (17, 9, 5)], ids=str)
def test_fused_grouped_with_padding_and_unaligned_layouts(lead: int, dims: tuple[int, int, int]) -> None:
    """in / out / r_max not multiples of grouped_mm's alignment (zero-padded copies) and segments that start off a
    16-byte boundary (dense copies) give the reference's results."""
    n_in, n_out, r_max = dims
    slots, ranks, scales, rows = [6, 1, 4], [r_max, 3, 2], [1.0, 2.0, 0.75], [5, 0, 30]
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), n_in, n_out, r_max, seed=sum(dims))
    routing = Routing.build(slots, ranks, scales, rows)
    x, grad = torch.randn(35, n_in), torch.randn(35, n_out)
    got = run_fused(x, a, b, routing, grad, lead=lead)
    want = run_op(lora_delta_reference, x, a, b, routing, grad)
    for gv, wv in zip(got, want, strict=True):
        torch.testing.assert_close(gv, wv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("groups", "single", "grouped"), [(1, True, True), (1, False, True), (3, True, True), (3, True, False)], ids=str
)
def test_base_matmul_fused_into_the_node_gives_the_layer_output_and_its_gradients(
    groups: int, single: bool, grouped: bool
) -> None:
    """With the base weight W, the node returns x @ W^T + delta and x.grad = grad @ W + the LoRA's dx (the same bank
    gradients): the CUDA path of SlotBankLinear, checked here in fp32 on the CPU."""
    slots, ranks, scales, rows = FUSED_CASES[groups]
    n_in, n_out, r_max = 24, 40, 8
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), n_in, n_out, r_max, seed=groups)
    routing = Routing.build(slots, ranks, scales, rows)
    g = torch.Generator().manual_seed(7)
    x, grad, w = (torch.randn(*s, generator=g) for s in ((routing.num_rows, n_in), (routing.num_rows, n_out), (n_out, n_in)))
    got = run_fused(x, a, b, routing, grad, grouped=grouped, single=single, base_weight=w)
    delta, x_grad, a_grad, b_grad = run_op(lora_delta_reference, x, a, b, routing, grad)
    for name, gv, wv in zip(
        ("y", "x.grad", "A grad", "B grad"), got, (x @ w.t() + delta, x_grad + grad @ w, a_grad, b_grad), strict=True
    ):
        torch.testing.assert_close(gv, wv, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ValueError, match="frozen"):
        run_fused(x, a, b, routing, grad, base_weight=w.t().contiguous())


def test_aligned_bank_views_are_read_in_place() -> None:
    """At aligned shapes (every real model: dims and rank multiples of 8) the grouped path reads `compute` itself."""
    flat = torch.zeros(3, 8 + 24 * 8 + 8 * 40, dtype=torch.bfloat16)
    banks = MicrobatchBanks(flat, None, grouped=True)
    a, b = banks.weights(BankLayout(8, 8 + 24 * 8, 24, 40, 8))
    assert gmm_operand(a) is a and gmm_operand(b) is b
    assert a.data_ptr() == flat.data_ptr() + 8 * 2
    shifted, _ = banks.weights(BankLayout(3, 3 + 24 * 8, 24, 40, 8))
    assert gmm_operand(shifted) is not shifted  # 6 bytes off: copied


def test_forward_only_microbatch_has_no_gradient_buffer() -> None:
    a, b = make_banks({1: 4, 2: 8}, 16, 16, 8, seed=3)
    flat = torch.cat([a.reshape(8, -1), b.reshape(8, -1)], dim=1)
    routing = Routing.build([2, 1], [8, 4], [1.0, 0.5], [3, 5])
    banks = MicrobatchBanks.gather(flat, routing, torch.float32, trainable=False, grouped=True)
    assert banks.grads is None and banks.trigger is None and banks.grad_views(BankLayout(0, 128, 16, 16, 8)) is None
    with torch.no_grad():
        y = lora_delta_fused(torch.randn(8, 16), BankLayout(0, 128, 16, 16, 8), banks, routing)
    assert not y.requires_grad


@pytest.mark.parametrize("groups", [1, 4])
def test_fused_bf16_on_cpu_stays_within_the_bf16_rounding_bound(groups: int) -> None:
    """bf16 activations (banks gathered and cast to bf16 once): every result within the bound of
    `check_against_fp32_reference` (|fused - fp32 reference| <= (8 u + 2 K u32) M, u = 2^-8) of the fp32 reference."""
    cases = {1: ([5], [16], [2.0], [80]), 4: ([2, 0, 5, 7], [16, 8, 3, 16], [2.0, 0.5, 4.0, 1.0], [40, 7, 0, 33])}
    slots, ranks, scales, rows = cases[groups]
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), 64, 48, 16, seed=9)
    routing = Routing.build(slots, ranks, scales, rows)
    g = torch.Generator().manual_seed(groups)
    x, grad = torch.randn(80, 64, generator=g), torch.randn(80, 48, generator=g)
    ratios = check_against_fp32_reference(x, a, b, routing, grad, torch.bfloat16, run=run_fused)
    assert max(ratios.values()) < 1


# ---- the whole engine ------------------------------------------------------------------------------------------------
def _never(*_: object) -> torch.Tensor:
    raise AssertionError("the fused engine must not run the per-layer op")


# One microbatch of all 4 adapters (4 groups, grouped_mm); token-capped microbatches of 1-3 groups with r_max 6 (padded
# copies); and the fused path's reference loop for several groups (lora_op given, fused forced on).
@pytest.mark.parametrize(
    ("max_rank", "microbatch_tokens", "fused_kw"),
    [(8, 4096, {}), (6, 40, {}), (8, 40, {"lora_op": lora_delta_reference, "fused_lora": True})],
    ids=["one-microbatch", "capped-padded", "fused-loop"],
)
def test_fused_engine_equals_reference_engine_over_three_steps(
    tiny_dir: Path, max_rank: int, microbatch_tokens: int, fused_kw: dict
) -> None:
    fused = make_engine(tiny_dir, max_rank, microbatch_tokens, **fused_kw)
    reference = make_engine(tiny_dir, max_rank, microbatch_tokens, lora_op=lora_delta_reference)
    assert fused.fused_lora and not reference.fused_lora
    for bank in fused.banks.values():
        bank.op = _never
    items = [
        ("b", make_data(1, [9, 4]), "cross_entropy", None, False),
        ("a", make_data(2, [5, 11, 3]), "cross_entropy", None, False),
        ("d", make_data(3, [7]), "cross_entropy", None, False),
        ("c", make_data(4, [6, 2, 8]), "cross_entropy", None, False),
        ("a", make_data(5, [4]), "cross_entropy", None, True),  # forward-only rows in the same batch
        ("placeholder", make_data(6, [5]), "cross_entropy", None, True),  # a forward-only adapter
    ]
    adam = {"learning_rate": 1e-2, "weight_decay": 0.01}
    for step in range(3):
        outs = [e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in (fused, reference)]
        for got, want in zip(*outs, strict=True):
            assert got["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], abs=1e-5, rel=1e-6)
            for dg, dw in zip(got["loss_fn_outputs"], want["loss_fn_outputs"], strict=True):
                torch.testing.assert_close(
                    torch.tensor(dg["logprobs"]), torch.tensor(dw["logprobs"]), atol=1e-5, rtol=0
                )
        for model_id in ["placeholder", *(a[0] for a in ADAPTERS)]:
            for name, (ga, gb) in fused.adapter_grads(model_id).items():
                ra, rb = reference.adapter_grads(model_id)[name]
                torch.testing.assert_close(
                    ga, ra, atol=1e-5, rtol=1e-5, msg=lambda m, n=f"step {step} {name}": f"{n}: {m}"
                )
                torch.testing.assert_close(
                    gb, rb, atol=1e-5, rtol=1e-5, msg=lambda m, n=f"step {step} {name}": f"{n}: {m}"
                )
        # The full gradient buffers agree too (other slots, rank padding: zero in both).
        torch.testing.assert_close(fused.optimizer.grad, reference.optimizer.grad, atol=1e-5, rtol=1e-5)
        trained = [a[0] for a in ADAPTERS]
        for engine in (fused, reference):
            assert all("metrics" in r for r in engine.optim_step([(m, adam) for m in trained]))
        torch.testing.assert_close(fused.optimizer.data, reference.optimizer.data, atol=1e-5, rtol=1e-5)
    for model_id, *_ in ADAPTERS:
        for name, (wa, wb) in fused.adapter_weights(model_id).items():
            ra, rb = reference.adapter_weights(model_id)[name]
            torch.testing.assert_close(wa, ra, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(wb, rb, atol=1e-5, rtol=1e-5)
    # The bank Parameters never entered the fused graph: their .grad is still the optimizer buffer's view.
    for bank in fused.banks.values():
        assert bank.lora_A.grad is not None and bank.lora_A.grad.untyped_storage().data_ptr() == (
            fused.optimizer.grad.untyped_storage().data_ptr()
        )


def test_fused_flag_can_be_flipped_between_calls(tiny_dir: Path) -> None:
    """The old per-layer path stays selectable on a live engine; both accumulate into the same gradients."""
    engine = make_engine(tiny_dir, 8, 4096)
    items = [
        ("a", make_data(7, [6, 3]), "cross_entropy", None, False),
        ("c", make_data(8, [5]), "cross_entropy", None, False),
    ]
    engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
    once = {m: engine.adapter_grads(m) for m in "ac"}
    engine.fused_lora = False
    engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
    for m in "ac":
        for name, (ga, gb) in engine.adapter_grads(m).items():
            torch.testing.assert_close(ga, 2 * once[m][name][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gb, 2 * once[m][name][1], atol=1e-5, rtol=1e-5)


def test_gradient_accumulation_off_cuda_adds_the_product_in_place() -> None:
    """`accumulate_matmul` off CUDA (cuBLAS's fp32-out GEMM is CUDA-only): the product in the operands' dtype, added to
    the fp32 gradient view in place; a strided view keeps its neighbours."""
    g = torch.Generator().manual_seed(0)
    m1, m2 = torch.randn(24, 40, generator=g).bfloat16(), torch.randn(40, 8, generator=g).bfloat16()
    wide = torch.randn(24, 16, generator=g)
    before = wide.clone()
    accumulate_matmul(wide[:, :8], m1, m2)
    assert torch.equal(wide[:, :8], before[:, :8] + (m1 @ m2).float())
    assert torch.equal(wide[:, 8:], before[:, 8:])
    assert matmul_into_float(m1, m2).dtype == torch.bfloat16
