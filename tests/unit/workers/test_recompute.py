"""Activation recomputation per decoder layer (workers/engine/recompute.py): a recomputed step is the plain step
(fp32, CPU: logprobs, LoRA gradients and the weights after an optim_step, several adapters in one microbatch), the
engine turns it on only above its token threshold, and a bad mode is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.recompute import RecomputePolicy
from tests.helpers.datums import datums, with_datums
from tests.helpers.gpu import flat_logprobs, random_data


def _engine(tiny_dir: Path, policy: RecomputePolicy) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    e = build_engine(model, EngineConfig(num_slots=4, max_rank=8, recompute=policy))
    for model_id, rank, seed in (("a", 4, 1), ("b", 8, 2)):
        e.create_adapter(model_id, rank, 2.0 * rank, seed)
    return e


def _count_recomputes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count torch.utils.checkpoint.checkpoint calls, the layers run for recomputation (still running them)."""
    calls = {"n": 0}
    real = torch.utils.checkpoint.checkpoint

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    return calls


def test_a_recomputed_step_equals_the_plain_one(tiny_dir: Path, monkeypatch) -> None:
    plain, recomputed = (_engine(tiny_dir, RecomputePolicy(m)) for m in ("never", "always"))
    calls = _count_recomputes(monkeypatch)
    g = torch.Generator().manual_seed(0)
    items = [(m, random_data(g, 2, 24), "cross_entropy", None, False) for m in "ab"]
    for _ in range(2):
        outs = [e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in (plain, recomputed)]
        torch.testing.assert_close(flat_logprobs(outs[1]), flat_logprobs(outs[0]), rtol=0, atol=1e-6)
        for m in "ab":
            for name, (ga, gb) in plain.adapter_grads(m).items():
                ra, rb = recomputed.adapter_grads(m)[name]
                torch.testing.assert_close(ra, ga, rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(rb, gb, rtol=1e-5, atol=1e-7)
        for e in (plain, recomputed):
            e.optim_step([(m, {"learning_rate": 1e-2}) for m in "ab"])
    layers = len(plain.body.layers)
    assert calls["n"] == 2 * layers  # the recomputing engine's two steps, every layer; the plain engine's none
    for m in "ab":
        for name, (wa, wb) in plain.adapter_weights(m).items():
            ra, rb = recomputed.adapter_weights(m)[name]
            torch.testing.assert_close(ra, wa, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(rb, wb, rtol=1e-5, atol=1e-7)


def test_auto_recomputes_only_microbatches_above_the_threshold(tiny_dir: Path, monkeypatch) -> None:
    e = _engine(tiny_dir, RecomputePolicy("auto", above_tokens=40))
    calls = _count_recomputes(monkeypatch)
    g = torch.Generator().manual_seed(1)
    e.forward_backward([e.prepare("a", datums(random_data(g, 1, 32)), "cross_entropy", None, False)])
    assert calls["n"] == 0
    e.forward_backward([e.prepare("a", datums(random_data(g, 2, 32)), "cross_entropy", None, False)])  # 64 tokens
    assert calls["n"] == len(e.body.layers)
    e.forward_backward(
        [e.prepare("a", datums(random_data(g, 2, 32)), "cross_entropy", None, True)]
    )  # forward only: none
    assert calls["n"] == len(e.body.layers)


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, always or never"):
        RecomputePolicy("sometimes")
    with pytest.raises(ValueError, match="positive"):
        RecomputePolicy("auto", 0)
