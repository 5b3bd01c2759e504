"""The reference LoRA op and slot banks: semantics, routing once per microbatch, zero padding exactness, guards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.errors import InvalidRequestError
from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import Routing, lora_delta_reference, siblings, slot_bank
from tests.helpers.datums import datums


def make_engine(tiny_dir: Path, **kw) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(**{"num_slots": 4, "max_rank": 16, **kw}))


def datum(ids: list[int]) -> dict:
    return {"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}}


def random_data(seed: int, lengths: list[int], vocab: int = 512) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [datum(torch.randint(0, vocab, (n + 1,), generator=g).tolist()) for n in lengths]


def test_reference_op_matches_per_row_semantics() -> None:
    g = torch.Generator().manual_seed(0)
    slots, r_max, k, n = 5, 8, 12, 20
    a_bank = torch.randn(slots, k, r_max, generator=g)
    b_bank = torch.randn(slots, r_max, n, generator=g)
    routing = Routing.build(slots=[3, 0, 4], ranks=[2, 8, 5], scales=[0.5, 2.0, 1.25], group_rows=[4, 0, 7])
    x = torch.randn(11, k, generator=g)
    got = lora_delta_reference(x, a_bank, b_bank, routing)
    expected = torch.empty(11, n)
    owners = [(0, 3, 2, 0.5)] * 4 + [(2, 4, 5, 1.25)] * 7
    for row, (_, slot, rank, scale) in enumerate(owners):
        expected[row] = (x[row] @ a_bank[slot, :, :rank]) * scale @ b_bank[slot, :rank]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    single = Routing.build(slots=[1], ranks=[3], scales=[0.7], group_rows=[11])
    torch.testing.assert_close(
        lora_delta_reference(x, a_bank, b_bank, single), (x @ a_bank[1, :, :3]) * 0.7 @ b_bank[1, :3], atol=0, rtol=0
    )
    with pytest.raises(ValueError):
        lora_delta_reference(x[:5], a_bank, b_bank, routing)  # rows must be covered by the groups


def test_reference_op_gradients_stay_in_real_rank_and_owner_slots() -> None:
    g = torch.Generator().manual_seed(1)
    a_bank = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    b_bank = torch.randn(4, 8, 5, generator=g, requires_grad=True)
    routing = Routing.build(slots=[2, 1], ranks=[3, 8], scales=[1.0, 0.5], group_rows=[5, 3])
    lora_delta_reference(torch.randn(8, 6, generator=g), a_bank, b_bank, routing).square().sum().backward()
    assert a_bank.grad[2, :, :3].abs().sum() > 0 and a_bank.grad[1].abs().sum() > 0
    assert torch.count_nonzero(a_bank.grad[2, :, 3:]) == 0 and torch.count_nonzero(b_bank.grad[2, 3:]) == 0
    assert torch.count_nonzero(a_bank.grad[[0, 3]]) == 0 and torch.count_nonzero(b_bank.grad[[0, 3]]) == 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-layer-op"])
def test_routing_is_built_once_per_microbatch_and_shared_by_every_layer(
    tiny_dir: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer of a microbatch sees the same Routing object (and, fused, the same gathered MicrobatchBanks), whether
    it runs alone or in a sibling node (q/k/v, gate/up: counted once per layer of the node)."""
    engine = make_engine(tiny_dir, microbatch_tokens=16, fused_lora=fused)  # packed: 7 + 9 and 8 + 6 tokens
    engine.create_adapter("a", 4, 8.0, seed=1)
    engine.create_adapter("b", 8, 8.0, seed=2)
    seen: list[object] = []  # the routing objects themselves: kept alive, so identity is meaningful
    gathered: list[object] = []
    if fused:
        inner_fused = slot_bank.lora_delta_fused

        def spy(x: torch.Tensor, layout: object, banks: object, routing: Routing, **kw: object) -> torch.Tensor:
            seen.append(routing)
            gathered.append(banks)
            return inner_fused(x, layout, banks, routing, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(slot_bank, "lora_delta_fused", spy)
        inner_siblings = siblings.lora_siblings_fused

        def spy_siblings(x: torch.Tensor, layouts: list, banks: object, routing: Routing, *rest: object) -> tuple:
            seen.extend([routing] * len(layouts))
            gathered.extend([banks] * len(layouts))
            return inner_siblings(x, layouts, banks, routing, *rest)  # type: ignore[arg-type]

        monkeypatch.setattr(siblings, "lora_siblings_fused", spy_siblings)
    for bank in engine.banks.values():
        inner = bank.op
        bank.op = lambda x, a, b, routing, inner=inner: (seen.append(routing), inner(x, a, b, routing))[1]
    engine.forward_backward(
        [
            engine.prepare("a", datums(random_data(0, [7, 9])), "cross_entropy", None, False),
            engine.prepare("b", datums(random_data(1, [8, 6])), "cross_entropy", None, False),
        ]
    )
    per_layer = len(engine.banks)
    distinct = list({id(r): r for r in seen}.values())
    assert len(seen) % per_layer == 0 and len(distinct) == len(seen) // per_layer == 2  # 2 microbatches of 2 sequences
    assert all(r is distinct[i // per_layer] for i, r in enumerate(seen))
    if fused:  # one gather per microbatch, shared by every layer
        assert len(gathered) == len(seen) and len({id(b) for b in gathered}) == 2
        assert all(b is gathered[i // per_layer * per_layer] for i, b in enumerate(gathered))


def test_rank_padding_is_exact(tiny_dir: Path) -> None:
    """A rank-4 adapter in an r_max-16 bank behaves exactly like one in an r_max-4 bank, and its padding stays zero."""
    wide, narrow = make_engine(tiny_dir, max_rank=16), make_engine(tiny_dir, max_rank=4)
    for engine in (wide, narrow):
        engine.create_adapter("other", 4, 4.0, seed=9)  # occupy slot 0, so the slots differ from a fresh bank
        engine.create_adapter("a", 4, 16.0, seed=3)
    data = random_data(5, [6, 11, 3])
    for step in range(3):
        out_w = wide.forward_backward([wide.prepare("a", datums(data), "cross_entropy", None, False)])
        out_n = narrow.forward_backward([narrow.prepare("a", datums(data), "cross_entropy", None, False)])
        assert out_w[0]["metrics"]["loss:sum"] == pytest.approx(out_n[0]["metrics"]["loss:sum"], abs=1e-5)
        for d_w, d_n in zip(out_w[0]["loss_fn_outputs"], out_n[0]["loss_fn_outputs"], strict=True):
            torch.testing.assert_close(torch.tensor(d_w["logprobs"]), torch.tensor(d_n["logprobs"]), atol=1e-5, rtol=0)
        if step == 2:  # unconsumed gradients: padding of the gradient is zero too
            slot = wide.adapter("a").slot
            for bank in wide.banks.values():
                assert torch.count_nonzero(bank.lora_A.grad[slot, :, 4:]) == 0
                assert torch.count_nonzero(bank.lora_B.grad[slot, 4:]) == 0
        for engine in (wide, narrow):
            (res,) = engine.optim_step([("a", {"learning_rate": 1e-2, "weight_decay": 0.1})])
            assert "metrics" in res
    slot = wide.adapter("a").slot
    for i, bank in enumerate(wide.banks.values()):
        assert torch.count_nonzero(bank.lora_A[slot, :, 4:]) == 0 and torch.count_nonzero(bank.lora_B[slot, 4:]) == 0
        m_a, v_a = wide.optimizer.exp_avg[2 * i], wide.optimizer.exp_avg_sq[2 * i]
        assert torch.count_nonzero(m_a[slot, :, 4:]) == 0 and torch.count_nonzero(v_a[slot, :, 4:]) == 0
    for name, (a_w, b_w) in wide.adapter_weights("a").items():
        a_n, b_n = narrow.adapter_weights("a")[name]
        torch.testing.assert_close(a_w, a_n, atol=1e-6, rtol=0)
        torch.testing.assert_close(b_w, b_n, atol=1e-6, rtol=0)


def test_target_modules_are_configurable_and_validated(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, target_modules=("q_proj", "v_proj"))
    assert sorted({n.rsplit(".", 1)[-1] for n in engine.banks}) == ["q_proj", "v_proj"]
    assert len(engine.banks) == 2 * 2  # two layers
    with pytest.raises(InvalidRequestError, match="unknown target modules"):
        make_engine(tiny_dir, target_modules=("q_proj", "query_key_value"))
    with pytest.raises(InvalidRequestError, match="output head"):
        make_engine(tiny_dir, target_modules=("lm_head",))


def test_base_is_frozen_and_a_trainable_non_lora_parameter_is_refused(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    engine.create_adapter("a", 4, 8.0, seed=0)
    engine.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(InvalidRequestError, match="non-LoRA"):
        engine.forward_backward([engine.prepare("a", datums(random_data(0, [5])), "cross_entropy", None, False)])


def test_rank_above_r_max_is_refused(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_rank=8)
    with pytest.raises(InvalidRequestError, match="rank"):
        engine.create_adapter("a", 16, 16.0, seed=0)
    assert engine.free_slots == 4
