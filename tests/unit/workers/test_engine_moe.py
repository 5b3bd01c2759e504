"""The engine on a mixture-of-experts base: the `tiny-moe` preset (Qwen3-MoE, 4 experts, 2 per token) with
LoRA on attention and on every expert's gate / up / down. Three adapters of different ranks trained together in mixed
batches for 5 steps on the fast paths (fused dense banks, grouped expert LoRA) equal each adapter trained alone on the
plain-torch reference ops (the dense loop, `experts_reference`): losses, logprobs and weights, fp32, <= 1e-5. Also
checkpoints (a documented layout), the PEFT export (PEFT loads it and computes the same logprobs); swaps: tests/unit/workers/test_adapter_store.py; the Tinker SDK:
tests/e2e/test_tinker_sdk_moe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import lora_delta_reference
from loraplex.workers.lora.expert_bank import ExpertProjectionBank, SlotBankExperts
from tests.helpers.datums import datums
from tests.helpers.lora import make_data

ADAPTERS = [("a", 2, 4.0, 1), ("b", 4, 16.0, 2), ("c", 8, 8.0, 3)]  # model_id, rank, alpha, seed
DATA = {"a": make_data(10, [5, 9]), "b": make_data(11, [13, 2, 7]), "c": make_data(12, [6])}


@pytest.fixture
def moe_dir(tiny_moe_dir: Path) -> Path:
    return tiny_moe_dir


def _engine(moe_dir: Path, **kw: object) -> Engine:
    model, _ = load_base_model(str(moe_dir), moe_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=4, max_rank=8, **kw))  # type: ignore[arg-type]
    for model_id, rank, alpha, seed in ADAPTERS:
        engine.create_adapter(model_id, rank, alpha, seed)
        g = torch.Generator().manual_seed(seed + 1000)  # non-zero B everywhere, experts included
        weights = engine.adapter_weights(model_id)
        engine.load_adapter_weights(
            model_id, {n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in weights.items()}
        )
    return engine


def test_expert_banks_are_installed_beside_the_attention_banks(moe_dir: Path) -> None:
    engine = _engine(moe_dir)
    experts = [m for m in engine.model.modules() if isinstance(m, SlotBankExperts)]
    assert len(experts) == 2 and all(m.grouped for m in experts)  # grouped_mm on the CPU
    expert_banks = {n: b for n, b in engine.banks.items() if isinstance(b, ExpertProjectionBank)}
    assert sorted(n.rsplit(".", 1)[-1] for n in expert_banks) == sorted(["down_proj", "gate_proj", "up_proj"] * 2)
    assert len(engine.banks) - len(expert_banks) == 2 * 4  # q, k, v, o per layer
    a, b = engine.adapter_weights("c")["model.layers.0.mlp.experts.gate_proj"]
    assert a.shape == (4, 64, 8) and b.shape == (4, 8, 32)
    assert engine.dense_width < engine.slot_width  # the expert columns follow the dense ones
    assert not any(p.requires_grad for n, p in engine.model.named_parameters() if "lora_" not in n)  # router frozen


@pytest.mark.parametrize("max_groups", [1023, 5], ids=["one-grouped-call", "chunks-of-groups"])
def test_mixed_moe_training_equals_each_adapter_alone_on_the_reference(moe_dir: Path, max_groups: int) -> None:
    fast = _engine(moe_dir)
    for m in fast.model.modules():
        if isinstance(m, SlotBankExperts):
            m.max_groups = max_groups  # 5: 4 experts x 3 groups run in chunks of 5 (experts.py, `_lora_pairs`)
    reference = _engine(moe_dir, lora_op=lora_delta_reference)
    assert not any(m.grouped for m in reference.model.modules() if isinstance(m, SlotBankExperts))
    adam = {"learning_rate": 1e-2, "weight_decay": 0.01}
    before = {m: fast.adapter_weights(m) for m, *_ in ADAPTERS}
    for _ in range(5):
        mixed = fast.forward_backward(
            [fast.prepare(m, datums(DATA[m]), "cross_entropy", None, False) for m, *_ in ADAPTERS]
        )
        fast.optim_step([(m, adam) for m, *_ in ADAPTERS])
        for (model_id, *_), got in zip(ADAPTERS, mixed, strict=True):
            (want,) = reference.forward_backward(
                [reference.prepare(model_id, datums(DATA[model_id]), "cross_entropy", None, False)]
            )
            reference.optim_step([(model_id, adam)])
            assert got["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], abs=1e-4)
            for x, y in zip(got["loss_fn_outputs"], want["loss_fn_outputs"], strict=True):
                torch.testing.assert_close(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-5, rtol=0)
    for model_id, *_ in ADAPTERS:
        got_w, want_w = fast.adapter_weights(model_id), reference.adapter_weights(model_id)
        for name in want_w:
            for g, w in zip(got_w[name], want_w[name], strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        for name in ("model.layers.0.mlp.experts.gate_proj", "model.layers.1.mlp.experts.down_proj"):
            for now, then in zip(got_w[name], before[model_id][name], strict=True):
                assert (now - then).abs().max() > 1e-3, name  # the expert banks trained, A and B


def test_an_moe_adapter_checkpoints_and_restores_bit_for_bit(moe_dir: Path, tmp_path: Path) -> None:
    from loraplex.workers.state.checkpoint import read_checkpoint, write_checkpoint
    from loraplex.workers.state.checkpoint_state import load_into_engine, state_from_engine

    engine = _engine(moe_dir)
    data = [engine.prepare("b", datums(DATA["b"]), "cross_entropy", None, False)]
    engine.forward_backward(data)
    engine.optim_step([("b", {"learning_rate": 1e-2})])
    write_checkpoint(state_from_engine(engine, "b", base_model="tiny-moe", with_optimizer=True), tmp_path / "ckpt")
    state = read_checkpoint(tmp_path / "ckpt")
    a, b = state.weights["model.layers.1.mlp.experts.up_proj"]
    assert a.shape == (4, 4, 64) and b.shape == (4, 32, 4)  # [E, r, in], [E, out, r]
    fresh = _engine(moe_dir)
    load_into_engine(fresh, state, "b2", with_optimizer=True, existing=False)
    for name, (wa, wb) in engine.adapter_weights("b").items():
        ga, gb = fresh.adapter_weights("b2")[name]
        assert torch.equal(wa, ga) and torch.equal(wb, gb), name
    # training continues identically from the restored state
    for e, model_id in ((engine, "b"), (fresh, "b2")):
        e.forward_backward([e.prepare(model_id, datums(DATA["b"]), "cross_entropy", None, False)])
        e.optim_step([(model_id, {"learning_rate": 1e-2})])
    for name, (wa, wb) in engine.adapter_weights("b").items():
        ga, gb = fresh.adapter_weights("b2")[name]
        assert torch.equal(wa, ga) and torch.equal(wb, gb), name


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "up_proj", "down_proj"], ["gate_proj"]])
def test_peft_loads_the_exported_moe_adapter_and_computes_what_the_engine_does(
    moe_dir: Path, tmp_path: Path, targets: list[str] | None
) -> None:
    """PEFT's target_parameters LoRA on the fused experts (service/peft_export.py), gate and up fused at rank 2r."""
    from peft import PeftModel

    from loraplex.workers.state.checkpoint_state import state_from_engine
    from tests.helpers.peft import export_peft

    model, _ = load_base_model(str(moe_dir), moe_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=8))
    engine.create_adapter("x", 4, 12.0, 5, target_modules=targets)
    g = torch.Generator().manual_seed(9)
    weights = engine.adapter_weights("x")
    engine.load_adapter_weights("x", {n: (a, 0.2 * torch.randn(b.shape, generator=g)) for n, (a, b) in weights.items()})
    ids = [5, 17, 99, 3, 250, 41, 8, 77, 64, 12]
    datum = {"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * 9}}
    (ours,) = engine.forward_backward(
        [engine.prepare("x", datums([datum]), "cross_entropy", None, True)]
    )  # forward only
    export_peft(state_from_engine(engine, "x", base_model="tiny-moe", with_optimizer=False), tmp_path / "peft")

    base, _ = load_base_model(str(moe_dir), moe_dir.parent)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        logits = peft_model(torch.tensor([ids[:-1]])).logits[0].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
    torch.testing.assert_close(torch.tensor(ours["loss_fn_outputs"][0]["logprobs"]), theirs, atol=1e-5, rtol=1e-5)
    with peft_model.disable_adapter(), torch.no_grad():
        without = torch.log_softmax(peft_model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    assert (without.gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1) - theirs).abs().max() > 1e-3  # LoRA matters
