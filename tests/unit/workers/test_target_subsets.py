"""Adapters that train a subset of the pool's target modules (Tinker's lora_config train_attn / train_mlp): the other
modules' A and B stay exactly zero through training (weight decay, clipping, eps = 0, swaps), the adapter trains like a
PEFT model with only those target modules, mixes with full-module adapters as if alone, and checkpoints, restores and
exports as that subset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from loraplex.errors import InvalidRequestError
from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, CreateAdapterPayload, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.state.adapter_store import AdapterStore
from loraplex.workers.state.checkpoint import read_checkpoint, write_checkpoint
from loraplex.workers.state.checkpoint_state import load_into_engine, state_from_engine
from tests.helpers.datums import datums, with_datums
from tests.helpers.lora import make_data
from tests.helpers.peft import export_peft

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAM = {"learning_rate": 1e-2, "weight_decay": 0.1, "grad_clip_norm": 0.5, "eps": 1e-8}


def make_engine(tiny_dir: Path, **kw) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(**{"num_slots": 3, "max_rank": 8, **kw}))


def excluded_banks(engine: Engine, model_id: str) -> list[str]:
    record = engine.adapter(model_id)
    return [name for name in engine.banks if name not in engine.adapter_modules(record)]


def assert_excluded_zero(engine: Engine, model_id: str) -> None:
    """A and B of every module the adapter does not train, their gradients and Adam moments: exactly zero."""
    slot = engine.adapter(model_id).slot
    names = excluded_banks(engine, model_id)
    assert names
    for name in names:
        bank = engine.banks[name]
        for p in (bank.lora_A, bank.lora_B):
            assert torch.count_nonzero(p[slot]) == 0, name
            assert p.grad is None or torch.count_nonzero(p.grad[slot]) == 0, name
    opt = engine.optimizer
    for i, name in enumerate(engine.banks):
        if name in names:
            for j in (2 * i, 2 * i + 1):
                assert torch.count_nonzero(opt.exp_avg[j][slot]) == 0 and torch.count_nonzero(opt.exp_avg_sq[j][slot]) == 0


def with_random_b(engine: Engine, model_id: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    weights = {n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in engine.adapter_weights(model_id).items()}
    engine.load_adapter_weights(model_id, weights)


def peft_twin(tiny_dir: Path, engine: Engine, model_id: str, target_modules: list[str]) -> torch.nn.Module:
    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    record = engine.adapter(model_id)
    model = get_peft_model(
        base, LoraConfig(r=record.rank, lora_alpha=record.alpha, target_modules=target_modules, lora_dropout=0.0)
    )
    lora_params = {k for k, _ in model.named_parameters() if ".lora_" in k}
    state = {}
    for name, (a, b) in engine.adapter_weights(model_id).items():
        state[f"base_model.model.{name}.lora_A.default.weight"] = a.t().contiguous()
        state[f"base_model.model.{name}.lora_B.default.weight"] = b.t().contiguous()
    assert set(state) == lora_params  # exactly the subset's modules on both sides
    model.load_state_dict(state, strict=False)
    return model


def peft_loss(model: torch.nn.Module, data: list[dict]) -> torch.Tensor:
    loss = torch.zeros(())
    for d in data:
        logits = model(input_ids=torch.tensor([d["model_input"]])).logits[0].float()
        lp = logits.log_softmax(-1).gather(1, torch.tensor(d["loss_fn_inputs"]["target_tokens"])[:, None])[:, 0]
        loss = loss - lp.sum()
    return loss


def test_create_zeroes_the_excluded_modules_and_keeps_the_seeded_init(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    engine.create_adapter("full", 4, 8.0, seed=5)
    engine.create_adapter("attn", 4, 8.0, seed=5, target_modules=list(reversed(ATTN)))
    record = engine.adapter("attn")
    assert record.target_modules == ATTN  # the pool's order
    full, attn = engine.adapter_weights("full"), engine.adapter_weights("attn")
    assert set(attn) == {n for n in full if n.rsplit(".", 1)[-1] in ATTN} and len(attn) < len(full)
    assert all(torch.equal(attn[n][0], full[n][0]) for n in attn)  # the same init as a full adapter of that seed
    assert_excluded_zero(engine, "attn")
    assert engine.create_adapter("all", 4, 8.0, seed=1, target_modules=engine.target_modules).target_modules is None
    for bad, match in [([], "empty"), (["q_proj", "lm_head"], "not among this pool's"), ("q_proj", "a list")]:
        with pytest.raises(InvalidRequestError, match=match):
            engine.resolve_target_modules(bad)
    with pytest.raises(InvalidRequestError, match="not among"):
        engine.create_adapter("x", 4, 8.0, seed=1, target_modules=["nope_proj"])
    assert not engine.is_resident("x") and engine.free_slots == 0


# eps at the smallest an fp32 sum keeps: untargeted modules' zero rows must stay zero (no 0/0 leaking into them).
@pytest.mark.parametrize("adam", [ADAM, {"learning_rate": 1e-2, "eps": 1e-30}], ids=["decay-clip", "tiny-eps"])
def test_attention_only_adapter_trains_like_peft_with_those_modules(tiny_dir: Path, adam: dict) -> None:
    engine = make_engine(tiny_dir)
    engine.create_adapter("neighbour", 8, 8.0, seed=3)  # a full adapter beside it, trained in the same batches
    engine.create_adapter("a", 4, 8.0, seed=4, target_modules=ATTN)
    with_random_b(engine, "neighbour", 30)  # no exactly-zero gradients on trained modules
    with_random_b(engine, "a", 40)
    data = make_data(50, [6, 11, 4])
    peft_model = peft_twin(tiny_dir, engine, "a", list(ATTN))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=adam["learning_rate"], betas=(0.9, 0.95), eps=adam.get("eps", 1e-12),
        weight_decay=adam.get("weight_decay", 0.0),
    )  # fmt: skip
    for _ in range(5):
        loss = peft_loss(peft_model, data)
        loss.backward()
        if adam.get("grad_clip_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
        opt.step()
        opt.zero_grad()
        out = engine.forward_backward(
            [
                engine.prepare("a", datums(data), "cross_entropy", None, False),
                engine.prepare("neighbour", datums(data), "cross_entropy", None, False),
            ]
        )[0]
        assert out["metrics"]["loss:sum"] == pytest.approx(loss.item(), abs=1e-4)
        res = engine.optim_step([("a", adam), ("neighbour", adam)])
        assert all("metrics" in r for r in res), res
        assert_excluded_zero(engine, "a")
    peft_state = peft_model.state_dict()
    for name, (a, b) in engine.adapter_weights("a").items():
        assert (a - peft_state[f"base_model.model.{name}.lora_A.default.weight"].t()).abs().max() <= 1e-5, name
        assert (b - peft_state[f"base_model.model.{name}.lora_B.default.weight"].t()).abs().max() <= 1e-5, name
    assert any(torch.count_nonzero(b) > 0 for _, b in engine.adapter_weights("a").values())


def test_subset_and_full_adapters_in_one_batch_each_equal_alone(tiny_dir: Path) -> None:
    adapters = [("attn", 4, 8.0, 1, ATTN), ("mlp", 8, 16.0, 2, ("gate_proj", "up_proj", "down_proj")),
                ("full", 2, 4.0, 3, None)]  # fmt: skip
    data = {"attn": make_data(60, [5, 9]), "mlp": make_data(61, [7]), "full": make_data(62, [3, 8])}
    mixed, alone = make_engine(tiny_dir), make_engine(tiny_dir)
    for engine in (mixed, alone):
        for model_id, rank, alpha, seed, modules in adapters:
            engine.create_adapter(model_id, rank, alpha, seed, target_modules=modules)
            with_random_b(engine, model_id, seed + 100)
    for _ in range(3):
        items = [(m, data[m], "cross_entropy", None, False) for m, *_ in adapters]
        together = mixed.forward_backward([mixed.prepare(*with_datums(it)) for it in items])
        for item, got in zip(items, together, strict=True):
            expected = alone.forward_backward([alone.prepare(*with_datums(item))])[0]
            assert got["metrics"]["loss:sum"] == pytest.approx(expected["metrics"]["loss:sum"], abs=1e-4)
            for x, y in zip(got["loss_fn_outputs"], expected["loss_fn_outputs"], strict=True):
                torch.testing.assert_close(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-5, rtol=0)
        for model_id, *_ in adapters:
            g_mixed, g_alone = mixed.adapter_grads(model_id), alone.adapter_grads(model_id)
            for name in g_mixed:
                for t1, t2 in zip(g_mixed[name], g_alone[name], strict=True):
                    torch.testing.assert_close(t1, t2, atol=1e-5, rtol=1e-5)
        mixed.optim_step([(m, ADAM) for m, *_ in adapters])
        for model_id, *_ in adapters:
            alone.optim_step([(model_id, ADAM)])
    for model_id, *_ in adapters:
        for name, (a, b) in mixed.adapter_weights(model_id).items():
            a2, b2 = alone.adapter_weights(model_id)[name]
            torch.testing.assert_close(a, a2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(b, b2, atol=1e-5, rtol=1e-5)
        if model_id != "full":
            assert_excluded_zero(mixed, model_id)


def trained_subset_engine(tiny_dir: Path) -> Engine:
    engine = make_engine(tiny_dir)
    engine.create_adapter("a", 4, 6.0, seed=8, target_modules=["v_proj", "q_proj"])
    data = make_data(70, [9, 5])
    for _ in range(3):
        engine.forward_backward([engine.prepare("a", datums(data), "cross_entropy", None, False)])
        engine.optim_step([("a", {"learning_rate": 2e-2})])
    return engine


def test_checkpoint_round_trip_keeps_the_subset(tiny_dir: Path, tmp_path: Path) -> None:
    engine = trained_subset_engine(tiny_dir)
    state = state_from_engine(engine, "a", base_model="tiny", with_optimizer=True)
    assert state.target_modules == ("q_proj", "v_proj")
    assert set(state.modules) == set(engine.adapter_weights("a")) and len(state.modules) < len(engine.banks)
    write_checkpoint(state, tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert manifest["signature"]["target_modules"] == ["q_proj", "v_proj"]
    back = read_checkpoint(tmp_path / "ckpt")
    fresh = make_engine(tiny_dir)
    fresh.create_adapter("other", 8, 8.0, seed=1)  # a full adapter in slot 0: the restore lands in slot 1
    record = load_into_engine(fresh, back, "b", with_optimizer=True, existing=False)
    assert record.target_modules == ("q_proj", "v_proj")
    assert_excluded_zero(fresh, "b")
    w1, w2 = engine.adapter_weights("a"), fresh.adapter_weights("b")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[n][i], w2[n][i]) for n in w1 for i in (0, 1))
    # Training continues bit-identically, and a load over an existing full adapter takes the checkpoint's subset.
    data = make_data(71, [6])
    for e, m in ((engine, "a"), (fresh, "b")):
        e.forward_backward([e.prepare(m, datums(data), "cross_entropy", None, False)])
        e.optim_step([(m, {"learning_rate": 2e-2, "weight_decay": 0.1})])
    w1, w2 = engine.adapter_weights("a"), fresh.adapter_weights("b")
    assert all(torch.equal(w1[n][i], w2[n][i]) for n in w1 for i in (0, 1))
    load_into_engine(fresh, back, "other", with_optimizer=False, existing=True)
    assert fresh.adapter("other").target_modules == ("q_proj", "v_proj")
    assert_excluded_zero(fresh, "other")


def test_subset_survives_swaps_through_host_and_disk(tiny_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_dir, num_slots=1)
    store = AdapterStore(engine, 0, tmp_path / "spill")  # host budget 0: every eviction spills to disk
    store.create("a", 4, 8.0, seed=2, target_modules=ATTN)
    store.create("b", 4, 8.0, seed=3)  # evicts "a" to disk
    assert store.tier_of("a") == "disk"
    store.ensure_resident(["a"])
    assert engine.adapter("a").target_modules == ATTN
    engine.forward_backward([engine.prepare("a", datums(make_data(80, [5])), "cross_entropy", None, False)])
    engine.optim_step([("a", ADAM)])
    assert_excluded_zero(engine, "a")


def test_export_of_a_subset_adapter_loads_in_peft_with_matching_logprobs(tiny_dir: Path, tmp_path: Path) -> None:
    engine = trained_subset_engine(tiny_dir)
    state = state_from_engine(engine, "a", base_model="tiny", with_optimizer=False)
    out = export_peft(state, tmp_path / "export", base_model_path=str(tiny_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]
    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    lora_keys = {k for k in peft_model.state_dict() if ".lora_" in k}
    assert lora_keys and all(k.split(".lora_")[0].rsplit(".", 1)[-1] in ("q_proj", "v_proj") for k in lora_keys)
    assert len(lora_keys) == 2 * len(state.modules)
    data = make_data(90, [7, 12])
    ours = engine.forward_backward([engine.prepare("a", datums(data), "cross_entropy", None, True)])[0]
    with torch.no_grad():
        for d, o in zip(data, ours["loss_fn_outputs"], strict=True):
            logits = peft_model(input_ids=torch.tensor([d["model_input"]])).logits[0].float()
            lp = logits.log_softmax(-1).gather(1, torch.tensor(d["loss_fn_inputs"]["target_tokens"])[:, None])[:, 0]
            assert (torch.tensor(o["logprobs"]) - lp).abs().max() <= 1e-5


def test_executor_creates_subset_adapters_and_refuses_bad_sets(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, num_slots=4)
    executor = PlanExecutor(engine)

    def create(request_id: str, model_id: str, modules: list[str] | None) -> PlannedRequest:
        targets = None if modules is None else tuple(modules)
        payload = CreateAdapterPayload(rank=4, alpha=8.0, seed=1, target_modules=targets)
        return PlannedRequest(request_id, "tenant", model_id, 0, RequestKind.CREATE_ADAPTER, payload)

    requests = (
        create("c1", "attn", list(ATTN)),
        create("c2", "empty", []),
        create("c3", "unknown", ["q_proj", "w_proj"]),
        create("c4", "full", None),
    )
    out = {o.request_id: o for o in executor.execute(BatchPlan(steps=(Step(StepKind.CREATE, requests),)))}
    assert out["c1"].ok and out["c4"].ok
    assert out["c2"].error_name == "InvalidRequestError" and "empty" in (out["c2"].error or "")
    assert out["c3"].error_name == "InvalidRequestError" and "w_proj" in (out["c3"].error or "")
    assert engine.adapter("attn").target_modules == ATTN and engine.adapter("full").target_modules is None
    assert not engine.is_resident("empty") and not engine.is_resident("unknown")
