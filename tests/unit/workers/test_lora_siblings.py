"""Sibling LoRA layers in one node (lora/siblings.py) against each layer's own fused node and the plain-torch reference:
outputs, x.grad and every sibling's bank gradients, for one group (host rank; a CUDA graph's r_max with the scale on the
device) and several groups (grouped_mm), with and without the base matmul fused in, x with and without grad, random and
zero-stride incoming gradients (fp32, 1e-5); bf16 within the rounding bound of the fp32 reference; the cases it hands
back to the layers alone; and the engine with sibling nodes on against off over three training steps (fp32: logprobs 1e-5; gradients and weights 1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.workers.lora import BankLayout, MicrobatchBanks, Routing, lora_delta_reference
from loraplex.workers.lora.siblings import siblings_fusable
from tests.helpers.datums import with_datums
from tests.helpers.lora import CASES, flat_sibling_banks, make_banks, make_data, make_engine, run_op, run_siblings

N_IN, R_MAX = 24, 8
OUTS = (40, 12, 12)  # q, k, v widths (k, v narrower, as with grouped-query attention)


def _case(groups: int, seed: int) -> tuple[torch.Tensor, list[BankLayout], Routing, torch.Tensor, list[torch.Tensor]]:
    slots, ranks, scales, rows = CASES[groups]
    used = dict(zip(slots, ranks, strict=True))
    banks = [make_banks(used, N_IN, n_out, R_MAX, seed=seed + i) for i, n_out in enumerate(OUTS)]
    flat, layouts = flat_sibling_banks(banks)
    routing = Routing.build(slots, ranks, scales, rows)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(routing.num_rows, N_IN, generator=g)
    grads = [torch.randn(routing.num_rows, n, generator=g) for n in OUTS]
    return flat, layouts, routing, x, grads


@pytest.mark.parametrize(
    ("groups", "single"), [(1, True), (1, False), (2, True), (3, True), (5, True)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("base", [False, True], ids=["delta", "base-fused"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-frozen"])
@pytest.mark.parametrize("zero_stride_grad", [False, True], ids=["random-grad", "y.sum"])
def test_one_node_equals_each_layer_alone_fp32(
    groups: int, single: bool, base: bool, x_grad: bool, zero_stride_grad: bool
) -> None:
    flat, layouts, routing, x, grads = _case(groups, seed=10 * groups)
    bases = [torch.randn(n, N_IN) for n in OUTS] if base else None
    incoming: list[torch.Tensor | None] = [None] * 3 if zero_stride_grad else list(grads)
    kw = {"single": single, "x_grad": x_grad, "bases": bases}
    got = run_siblings(flat, layouts, routing, x, incoming, together=True, **kw)  # type: ignore[arg-type]
    want = run_siblings(flat, layouts, routing, x, incoming, together=False, **kw)  # type: ignore[arg-type]
    for i, (o, w) in enumerate(zip(got[0], want[0], strict=True)):
        torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"output {i}: {m}")
    if x_grad:
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    else:
        assert got[1] is None
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    # Exact zeros where the layers alone have them: other layers' columns, slots outside the routing, rank padding.
    assert torch.equal(got[2] == 0, want[2] == 0)


def test_one_node_reads_unaligned_bank_views_through_copies() -> None:
    """Banks whose columns start off grouped_mm's 16-byte alignment (3 leading columns) give the layers' results."""
    slots, ranks, scales, rows = CASES[3]
    used = dict(zip(slots, ranks, strict=True))
    flat, layouts = flat_sibling_banks(
        [make_banks(used, N_IN, n, R_MAX, seed=60 + i) for i, n in enumerate(OUTS)], lead=3
    )
    routing = Routing.build(slots, ranks, scales, rows)
    x = torch.randn(routing.num_rows, N_IN)
    grads: list[torch.Tensor | None] = [torch.randn(routing.num_rows, n) for n in OUTS]
    got = run_siblings(flat, layouts, routing, x, grads, together=True)
    want = run_siblings(flat, layouts, routing, x, grads, together=False)
    for g, w in zip([*got[0], got[1], got[2]], [*want[0], want[1], want[2]], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_one_node_equals_the_plain_torch_reference() -> None:
    """The oracle itself: each sibling's delta and bank gradients as `lora_delta_reference` gives them, and x.grad the
    sum of the three layers' (4 groups, mixed ranks, empty groups)."""
    slots, ranks, scales, rows = CASES[4]
    used = dict(zip(slots, ranks, strict=True))
    banks = [make_banks(used, N_IN, n_out, R_MAX, seed=40 + i) for i, n_out in enumerate(OUTS)]
    flat, layouts = flat_sibling_banks(banks)
    routing = Routing.build(slots, ranks, scales, rows)
    x = torch.randn(routing.num_rows, N_IN)
    grads = [torch.randn(routing.num_rows, n) for n in OUTS]
    outs, x_grad, folded = run_siblings(flat, layouts, routing, x, list(grads), together=True)
    want_x_grad = torch.zeros_like(x)
    for (a, b), lay, out, grad in zip(banks, layouts, outs, grads, strict=True):
        delta, xg, ag, bg = run_op(lora_delta_reference, x, a, b, routing, grad)
        want_x_grad += xg
        torch.testing.assert_close(out, delta, atol=1e-5, rtol=1e-5)
        n_a, n_b = lay.in_features * lay.max_rank, lay.max_rank * lay.out_features
        torch.testing.assert_close(
            folded[:, lay.a_start : lay.a_start + n_a].reshape(a.shape), ag, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            folded[:, lay.b_start : lay.b_start + n_b].reshape(b.shape), bg, atol=1e-5, rtol=1e-5
        )
    torch.testing.assert_close(x_grad, want_x_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 3])
def test_one_node_in_bf16_stays_near_each_layer_alone(groups: int) -> None:
    """bf16 activations: the one node and the layers alone differ only by the rounding of products of other shapes
    (both within a few bf16 ulps of the fp32 results)."""
    flat, layouts, routing, x, grads = _case(groups, seed=77)
    exact = run_siblings(flat, layouts, routing, x, list(grads), together=False)
    for together in (True, False):
        got = run_siblings(flat, layouts, routing, x, list(grads), together=together, dtype=torch.bfloat16)
        for g, w in zip([*got[0], got[1]], [*exact[0], exact[1]], strict=True):
            assert g is not None and w is not None
            scale = w.abs().max().item()
            assert (g.float() - w).abs().max().item() <= 0.02 * scale
        assert (got[2] - exact[2]).abs().max().item() <= 0.02 * exact[2].abs().max().item()


def test_cases_the_node_does_not_cover_are_handed_back() -> None:
    flat, layouts, routing, x, _ = _case(3, seed=5)
    banks = MicrobatchBanks.gather(flat, routing, torch.float32, trainable=True, grouped=True)
    assert siblings_fusable(x, layouts, banks, routing)
    loop = MicrobatchBanks.gather(flat, routing, torch.float32, trainable=True, grouped=False)
    assert not siblings_fusable(x, layouts, loop, routing)  # the fp64-style reference loop: each alone
    odd = [BankLayout(lay.a_start, lay.b_start, 23, lay.out_features, R_MAX) for lay in layouts]
    assert not siblings_fusable(x[:, :23], odd, banks, routing)  # grouped_mm would need in padded
    mixed = [layouts[0], BankLayout(0, 0, N_IN, 12, 4)]
    assert not siblings_fusable(x, mixed, banks, routing)  # r_max differs
    one = Routing.build([5], [7], [0.5], [routing.num_rows])
    single = MicrobatchBanks.gather(flat, one, torch.float32, trainable=True, grouped=True)
    assert siblings_fusable(x[:, :23], odd, single, one)  # one group needs no grouped_mm alignment


@pytest.mark.parametrize("microbatch_tokens", [4096, 40], ids=["one-microbatch", "capped"])
def test_engine_with_sibling_nodes_trains_as_with_each_layer_alone(tiny_dir: Path, microbatch_tokens: int) -> None:
    """q/k/v and gate/up of every decoder layer in one node each (counted), against the same engine with the nodes
    off: logprobs, gradients and weights over three steps of four adapters."""
    shared = make_engine(tiny_dir, 8, microbatch_tokens)
    alone = make_engine(tiny_dir, 8, microbatch_tokens, shared_lora_inputs=False)
    layers = len(shared.model.model.layers)  # type: ignore[union-attr]
    assert len(shared.sibling_groups) == 2 * layers
    assert sorted(len(g.members) for g in shared.sibling_groups) == [2] * layers + [3] * layers
    items = [
        ("b", make_data(11, [9, 4]), "cross_entropy", None, False),
        ("a", make_data(12, [5, 11, 3]), "cross_entropy", None, False),
        ("d", make_data(13, [7]), "cross_entropy", None, False),
        ("c", make_data(14, [6, 2, 8]), "cross_entropy", None, True),
    ]
    adam = {"learning_rate": 1e-2, "weight_decay": 0.01}
    for _ in range(3):
        outs = [e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in (shared, alone)]
        for got, want in zip(*outs, strict=True):
            for dg, dw in zip(got["loss_fn_outputs"], want["loss_fn_outputs"], strict=True):
                torch.testing.assert_close(
                    torch.tensor(dg["logprobs"]), torch.tensor(dw["logprobs"]), atol=1e-5, rtol=0
                )
        # fp32 products of other shapes, summed over every token of a step: rounding reaches ~1.5e-5 here
        torch.testing.assert_close(shared.optimizer.grad, alone.optimizer.grad, atol=1e-4, rtol=1e-4)
        for e in (shared, alone):
            e.optim_step([(m, adam) for m in "abd"])
        torch.testing.assert_close(shared.optimizer.data, alone.optimizer.data, atol=1e-4, rtol=1e-4)
    assert all(g.fused_calls > 0 for g in shared.sibling_groups)
    assert all(g.fused_calls == 0 for g in alone.sibling_groups)
    assert all(not g._waiting for g in shared.sibling_groups)  # every output waiting was taken
