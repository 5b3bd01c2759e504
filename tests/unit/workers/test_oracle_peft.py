"""The external oracle (fp32, CPU): four adapters with different ranks, alphas, optimizer hyperparameters and loss functions
trained for 5 steps in mixed batches through Engine.forward_backward + Engine.optim_step equal, each, the same adapter
trained alone with PEFT + torch.optim.AdamW (+ clip_grad_norm_) from the same initial weights, with every loss written
out in plain torch on PEFT's logits. Plus: twins given identical data in the same batches stay bit-identical, and an
adapter's forward-only logprobs do not move while the others train around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from tests.helpers.datums import datums, with_datums

STEPS = 5
TOL = 1e-5
R_MAX = 16


@dataclass(frozen=True)
class Spec:
    model_id: str
    rank: int
    alpha: float
    seed: int
    adam: dict[str, float]
    losses: tuple[tuple[str, dict[str, float] | None], ...]  # one forward_backward item per (loss_fn, loss_fn_config)
    lengths: tuple[int, ...] = (6, 11)  # datum lengths of each item
    per_token_clip: bool = False  # the first datum carries its own clip thresholds (ppo / cispo)
    extra: dict[str, Any] = field(default_factory=dict)


SPECS = [
    Spec("sft", 2, 4.0, 1, {"learning_rate": 3e-3}, (("cross_entropy", None),), lengths=(9, 5, 13)),
    Spec(
        "is",
        4,
        16.0,
        2,
        {"learning_rate": 2e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1},
        (("importance_sampling", None),),
    ),
    Spec(
        "ppo",
        8,
        8.0,
        3,
        {"learning_rate": 1e-3, "weight_decay": 0.01, "grad_clip_norm": 0.05},  # the clip binds
        (("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),),
        lengths=(7, 10),
        per_token_clip=True,
    ),
    Spec(  # two losses for one adapter in the same batch
        "cispo-dro",
        16,
        32.0,
        4,
        {"learning_rate": 4e-3, "beta2": 0.9, "weight_decay": 0.05, "grad_clip_norm": 1e3},  # the clip never binds
        (("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.03}), ("dro", {"beta": 0.1})),
        lengths=(8, 4),
    ),
]


def make_engine(tiny_dir: Path, **kw: Any) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(**{"num_slots": 5, "max_rank": R_MAX, **kw}))


def token_data(seed: int, lengths: tuple[int, ...], vocab: int = 512) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n + 1,), generator=g).tolist()
        out.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}})
    return out


def current_logprobs(engine: Engine, model_id: str, data: list[dict]) -> list[torch.Tensor]:
    """The adapter's own logprobs now (forward only): the policy a sampler would have used."""
    out = engine.forward_backward([engine.prepare(model_id, datums(data), "cross_entropy", None, True)])[0]
    return [torch.tensor(o["logprobs"]) for o in out["loss_fn_outputs"]]


def with_loss_inputs(
    engine: Engine, model_id: str, data: list[dict], loss_fn: str, seed: int, per_token_clip: bool = False
) -> list[dict]:
    """Add what `loss_fn` reads: weights (cross_entropy), or sampling logprobs close to the adapter's current ones plus
    random advantages, zero on the first two ("prompt") tokens."""
    g = torch.Generator().manual_seed(seed)
    lps = current_logprobs(engine, model_id, data) if loss_fn != "cross_entropy" else [None] * len(data)
    out = []
    for i, (d, lp) in enumerate(zip(data, lps, strict=True)):
        n = len(d["model_input"])
        inputs = dict(d["loss_fn_inputs"])
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(n, generator=g).round().tolist()
        else:
            inputs["logprobs"] = (lp + 0.05 * torch.randn(n, generator=g)).tolist()
            adv = torch.randn(n, generator=g)
            adv[:2] = 0.0
            inputs["advantages"] = adv.tolist()
            if per_token_clip and i == 0:
                inputs["clip_low_threshold"] = (0.9 + 0.08 * torch.rand(n, generator=g)).tolist()
                inputs["clip_high_threshold"] = (1.02 + 0.08 * torch.rand(n, generator=g)).tolist()
        out.append({"model_input": d["model_input"], "loss_fn_inputs": inputs})
    return out


def step_items(engine: Engine, step: int) -> list[tuple]:
    """One mixed batch: every adapter's items, deliberately interleaved (the engine groups rows per adapter itself)."""
    per_adapter = []
    for a, spec in enumerate(SPECS):
        items = []
        for k, (loss_fn, config) in enumerate(spec.losses):
            seed = 1000 * step + 10 * a + k
            data = with_loss_inputs(
                engine, spec.model_id, token_data(seed, spec.lengths), loss_fn, seed, spec.per_token_clip
            )
            items.append((spec.model_id, data, loss_fn, config, False))
        per_adapter.append(items)
    mixed = []
    for k in range(max(len(x) for x in per_adapter)):
        mixed += [items[k] for items in reversed(per_adapter) if k < len(items)]
    return mixed


# ---- the oracle: PEFT + plain-torch losses + torch.optim.AdamW ---------------------------------------------------------
def oracle_loss(
    model: torch.nn.Module, data: list[dict], loss_fn: str, config: dict[str, float] | None
) -> torch.Tensor:
    cfg = config or {}
    total = torch.zeros(())
    for d in data:
        inp = d["loss_fn_inputs"]
        logits = model(input_ids=torch.tensor([d["model_input"]])).logits[0].float()
        lp = logits.log_softmax(-1).gather(1, torch.tensor(inp["target_tokens"])[:, None])[:, 0]
        if loss_fn == "cross_entropy":
            total = total - (torch.tensor(inp["weights"]) * lp).sum()
            continue
        q, adv = torch.tensor(inp["logprobs"]), torch.tensor(inp["advantages"])
        ratio = torch.exp(lp - q)
        lo = torch.tensor(inp["clip_low_threshold"]) if "clip_low_threshold" in inp else cfg.get("clip_low_threshold")
        hi = (
            torch.tensor(inp["clip_high_threshold"]) if "clip_high_threshold" in inp else cfg.get("clip_high_threshold")
        )
        if loss_fn == "importance_sampling":
            per_token = -(ratio * adv)
        elif loss_fn == "ppo":
            per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        elif loss_fn == "cispo":
            per_token = -(torch.clamp(ratio, lo, hi).detach() * lp * adv)
        elif loss_fn == "dro":
            per_token = -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2)
        else:
            raise AssertionError(loss_fn)
        total = total + per_token.sum()
    return total


def peft_twin(tiny_dir: Path, engine: Engine, spec: Spec) -> torch.nn.Module:
    """A fresh base with a PEFT adapter of the same r / alpha, our initial A copied in, B zero (PEFT's own init)."""
    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(engine.target_modules), lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    state = model.state_dict()
    with torch.no_grad():
        for name, (a, b) in engine.adapter_weights(spec.model_id).items():
            assert torch.count_nonzero(b) == 0
            assert torch.count_nonzero(state[f"base_model.model.{name}.lora_B.default.weight"]) == 0
            state[f"base_model.model.{name}.lora_A.default.weight"].copy_(a.t())
    return model


def test_four_adapters_in_mixed_batches_equal_peft_alone(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, microbatch_tokens=48, loss_chunk_tokens=16)  # several microbatches and loss chunks
    for spec in SPECS:
        engine.create_adapter(spec.model_id, spec.rank, spec.alpha, spec.seed)
    twins = {spec.model_id: peft_twin(tiny_dir, engine, spec) for spec in SPECS}
    opts = {}
    for spec in SPECS:
        params = [p for p in twins[spec.model_id].parameters() if p.requires_grad]
        h = spec.adam
        opts[spec.model_id] = torch.optim.AdamW(
            params,
            lr=h["learning_rate"],
            betas=(h.get("beta1", 0.9), h.get("beta2", 0.95)),
            eps=h.get("eps", 1e-12),
            weight_decay=h.get("weight_decay", 0.0),
        )
    worst = {"loss": 0.0, "weights": 0.0}
    clipped = False
    clip_fractions: dict[str, list[float]] = {}
    for step in range(STEPS):
        items = step_items(engine, step)
        results = engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
        assert len({(r[0], r[2]) for r in items}) == 5  # 4 adapters, 5 (adapter, loss) pairs in one batch
        for item, res in zip(items, results, strict=True):
            model_id, data, loss_fn, config, _ = item
            expected = oracle_loss(twins[model_id], data, loss_fn, config)
            expected.backward()  # gradients accumulate over the adapter's items, as in the engine
            clip_fractions.setdefault(loss_fn, []).append(res["metrics"].get("clip_fraction:mean", 0.0))
            diff = abs(res["metrics"]["loss:sum"] - expected.item())
            worst["loss"] = max(worst["loss"], diff)
            # the loss is a sum over the item's tokens: its fp32 rounding grows with it (42.3 off by 2.3e-5 seen in CI)
            assert diff <= TOL * max(1.0, abs(expected.item())), (
                step,
                model_id,
                loss_fn,
                res["metrics"]["loss:sum"],
                expected.item(),
            )
        stepped = engine.optim_step([(spec.model_id, spec.adam) for spec in SPECS])
        for spec, res in zip(SPECS, stepped, strict=True):
            assert isinstance(res, dict), res
            params = [p for p in twins[spec.model_id].parameters() if p.requires_grad]
            clip = spec.adam.get("grad_clip_norm", 0.0)
            norm = (
                torch.nn.utils.clip_grad_norm_(params, clip)
                if clip > 0
                else torch.nn.utils.get_total_norm([p.grad for p in params])
            )
            clipped |= clip > 0 and norm.item() > clip
            assert res["metrics"]["grad_norm:mean"] == pytest.approx(norm.item(), rel=1e-4, abs=1e-7)
            opts[spec.model_id].step()
            opts[spec.model_id].zero_grad()
        for spec in SPECS:
            state = twins[spec.model_id].state_dict()
            for name, (a, b) in engine.adapter_weights(spec.model_id).items():
                pa = state[f"base_model.model.{name}.lora_A.default.weight"].t()
                pb = state[f"base_model.model.{name}.lora_B.default.weight"].t()
                diff = max((a - pa).abs().max().item(), (b - pb).abs().max().item())
                worst["weights"] = max(worst["weights"], diff)
                assert diff <= TOL, (step, spec.model_id, name, diff)
    assert clipped  # the binding grad-clip path was exercised
    assert max(clip_fractions["ppo"]) > 0 and max(clip_fractions["cispo"]) > 0  # and the ratio clipping too
    for spec in SPECS:  # and training really moved every adapter (B left zero)
        assert all(torch.count_nonzero(b) > 0 for _, b in engine.adapter_weights(spec.model_id).values())
    print(f"worst abs diff: loss {worst['loss']:.2e}, weights {worst['weights']:.2e}")


def test_twins_given_identical_data_interleaved_stay_bit_identical(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, microbatch_tokens=4096, loss_chunk_tokens=16)
    for model_id, rank, alpha, seed in [("t1", 8, 16.0, 9), ("other", 4, 8.0, 3), ("t2", 8, 16.0, 9)]:
        engine.create_adapter(model_id, rank, alpha, seed)
    adam = {"learning_rate": 5e-3, "weight_decay": 0.01, "grad_clip_norm": 0.1}
    for step in range(STEPS):
        ppo = with_loss_inputs(engine, "t1", token_data(50 + step, (7, 12)), "ppo", 50 + step, per_token_clip=True)
        dro = with_loss_inputs(engine, "t1", token_data(60 + step, (5,)), "dro", 60 + step)
        ce = with_loss_inputs(engine, "other", token_data(70 + step, (9, 3)), "cross_entropy", 70 + step)
        items = [
            ("t1", ppo, "ppo", None, False),
            ("other", ce, "cross_entropy", None, False),
            ("t2", ppo, "ppo", None, False),
            ("t2", dro, "dro", {"beta": 0.5}, False),
            ("other", ppo, "importance_sampling", None, False),
            ("t1", dro, "dro", {"beta": 0.5}, False),
        ]
        out = engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
        assert out[0] == out[2] and out[3] == out[5]  # logprobs, loss:sum and metrics, bit for bit
        res = engine.optim_step([("t2", adam), ("other", {"learning_rate": 1e-2}), ("t1", adam)])
        assert res[0] == res[2]
        w1, w2 = engine.adapter_weights("t1"), engine.adapter_weights("t2")
        assert all(torch.equal(w1[n][i], w2[n][i]) for n in w1 for i in (0, 1)), step
    assert any(torch.count_nonzero(b) > 0 for _, b in engine.adapter_weights("t1").values())


def test_an_adapters_logprobs_do_not_change_while_others_train(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, microbatch_tokens=64, loss_chunk_tokens=16)
    for spec in SPECS:
        engine.create_adapter(spec.model_id, spec.rank, spec.alpha, spec.seed)
    engine.create_adapter("watched", 8, 16.0, 77)
    g = torch.Generator().manual_seed(5)  # give the watched adapter non-zero B so it is not just the base model
    engine.load_adapter_weights(
        "watched",
        {n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in engine.adapter_weights("watched").items()},
    )
    watched_data = with_loss_inputs(engine, "watched", token_data(99, (10, 6, 13)), "ppo", 99)
    training = step_items(engine, 0)  # the same training data every step: the batch layout stays the same
    weights_before = engine.adapter_weights("watched")
    alone_before = engine.forward_backward([engine.prepare("watched", datums(watched_data), "ppo", None, True)])[0]
    first = None
    for _ in range(4):
        # The watched adapter rides forward-only in the middle of the others' training batch.
        items = training[:2] + [("watched", watched_data, "ppo", None, True)] + training[2:]
        out = engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])[2]
        first = first or out
        assert out == first  # bit-identical logprobs, loss and metrics at every step
        assert all("metrics" in r for r in engine.optim_step([(s.model_id, s.adam) for s in SPECS]))
    assert (
        engine.forward_backward([engine.prepare("watched", datums(watched_data), "ppo", None, True)])[0] == alone_before
    )
    torch.testing.assert_close(  # batched or alone: the same numbers (to fp32 reduction order)
        torch.tensor([v for o in first["loss_fn_outputs"] for v in o["logprobs"]]),
        torch.tensor([v for o in alone_before["loss_fn_outputs"] for v in o["logprobs"]]),
        atol=1e-5,
        rtol=0,
    )
    for name, (a, b) in engine.adapter_weights("watched").items():
        assert torch.equal(a, weights_before[name][0]) and torch.equal(b, weights_before[name][1])
    assert all(torch.count_nonzero(t) == 0 for pair in engine.adapter_grads("watched").values() for t in pair)
    assert engine.optimizer.steps[engine.adapter("watched").slot] == 0
    trained = engine.adapter_weights(SPECS[0].model_id)  # while the others did move
    assert all(torch.count_nonzero(b) > 0 for _, b in trained.values())
