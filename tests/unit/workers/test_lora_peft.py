"""Our engine vs PEFT (the external oracle): same logprobs and loss for the same A/B, and the same weights after
3 steps of forward_backward + optim_step vs PEFT + torch.optim.AdamW run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from tests.helpers.datums import datums


def make_data(seed: int, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        ids = torch.randint(0, 512, (n + 1,), generator=g).tolist()
        weights = torch.rand(n, generator=g).round().tolist()  # prompt-style zero weights on some tokens
        data.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": weights}})
    return data


def peft_twin(tiny_dir: Path, engine: Engine, model_id: str) -> torch.nn.Module:
    """A PEFT model with the engine adapter's exact weights (PEFT stores A as [r, in] and B as [out, r])."""
    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    record = engine.adapter(model_id)
    config = LoraConfig(
        r=record.rank, lora_alpha=record.alpha, target_modules=list(engine.target_modules), lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    state = {}
    for name, (a, b) in engine.adapter_weights(model_id).items():
        state[f"base_model.model.{name}.lora_A.default.weight"] = a.t().contiguous()
        state[f"base_model.model.{name}.lora_B.default.weight"] = b.t().contiguous()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    return model


def peft_logprobs(model: torch.nn.Module, data: list[dict]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per datum target logprobs and the Tinker cross_entropy loss (weighted sum over all datums)."""
    lps, loss = [], torch.zeros(())
    for d in data:
        logits = model(input_ids=torch.tensor([d["model_input"]])).logits[0].float()
        lp = logits.log_softmax(-1).gather(1, torch.tensor(d["loss_fn_inputs"]["target_tokens"])[:, None])[:, 0]
        lps.append(lp)
        loss = loss - (torch.tensor(d["loss_fn_inputs"]["weights"]) * lp).sum()
    return lps, loss


@pytest.mark.parametrize(
    ("rank", "alpha", "adam"),
    [
        (4, 8.0, {"learning_rate": 1e-2}),
        (8, 32.0, {"learning_rate": 5e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}),
        (16, 16.0, {"learning_rate": 1e-2, "weight_decay": 0.01, "grad_clip_norm": 0.5}),
    ],
)
def test_engine_matches_peft(tiny_dir: Path, rank: int, alpha: float, adam: dict) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=3, max_rank=16))
    engine.create_adapter("neighbour", 2, 4.0, seed=11)  # another adapter resident; our adapter sits in slot 1
    engine.create_adapter("a", rank, alpha, seed=rank)
    # Give B non-zero values so the adapter changes the outputs from the first step.
    g = torch.Generator().manual_seed(100 + rank)
    engine.load_adapter_weights(
        "a", {n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in engine.adapter_weights("a").items()}
    )
    data = make_data(rank, [5, 12, 8])
    peft_model = peft_twin(tiny_dir, engine, "a")

    lps, loss = peft_logprobs(peft_model, data)
    out = engine.forward_backward([engine.prepare("a", datums(data), "cross_entropy", None, True)])[0]
    assert out["metrics"]["loss:sum"] == pytest.approx(loss.item(), abs=1e-4)
    for ours, theirs in zip(out["loss_fn_outputs"], lps, strict=True):
        assert (torch.tensor(ours["logprobs"]) - theirs).abs().max() <= 1e-5

    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=adam["learning_rate"],
        betas=(adam.get("beta1", 0.9), adam.get("beta2", 0.95)),
        eps=adam.get("eps", 1e-12),
        weight_decay=adam.get("weight_decay", 0.0),
    )
    for _ in range(3):
        _, loss = peft_logprobs(peft_model, data)
        loss.backward()
        if adam.get("grad_clip_norm", 0) > 0:
            torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"])
        opt.step()
        opt.zero_grad()
        out = engine.forward_backward([engine.prepare("a", datums(data), "cross_entropy", None, False)])[0]
        assert out["metrics"]["loss:sum"] == pytest.approx(loss.item(), abs=1e-4)
        (res,) = engine.optim_step([("a", adam)])
        assert "metrics" in res, res

    peft_state = peft_model.state_dict()
    for name, (a, b) in engine.adapter_weights("a").items():
        pa = peft_state[f"base_model.model.{name}.lora_A.default.weight"].t()
        pb = peft_state[f"base_model.model.{name}.lora_B.default.weight"].t()
        assert (a - pa).abs().max() <= 1e-5, name
        assert (b - pb).abs().max() <= 1e-5, name
