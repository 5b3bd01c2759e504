"""Tinker loss semantics and the chunked LM head."""

from __future__ import annotations

import pytest
import torch

from loraplex.models import load_base_model, resolve
from loraplex.workers.engine import Engine
from loraplex.workers.losses import LOSSES, target_logprobs


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    model, _ = load_base_model(str(folder), folder.parent)
    e = Engine(model, slots=2, max_rank=8, loss_chunk_tokens=5)  # several chunks per microbatch
    e.create_adapter("a", 8, 16.0, seed=0)
    return e


def test_chunked_head_equals_full_log_softmax_with_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (23,), generator=g)
    full = (hidden @ weight.T).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    (grad_full,) = torch.autograd.grad((full * torch.arange(23.0)).sum(), hidden)
    chunked = target_logprobs(hidden, weight, targets, chunk_tokens=4)
    (grad_chunked,) = torch.autograd.grad((chunked * torch.arange(23.0)).sum(), hidden)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_chunked, grad_full, atol=1e-5, rtol=1e-5)
    assert chunked.dtype == torch.float32


def test_cross_entropy_is_a_weighted_sum_over_datums(engine: Engine) -> None:
    data = [
        {"model_input": [5, 6, 7, 8], "loss_fn_inputs": {"target_tokens": [6, 7, 8, 9], "weights": [0, 0, 1, 0.5]}},
        {
            "model_input": [10, 11, 12, 13, 14, 15, 16],
            "loss_fn_inputs": {"target_tokens": [11, 12, 13, 14, 15, 16, 17], "weights": [1] * 7},
        },
    ]
    out = engine.forward_backward([("a", data, "cross_entropy", None, True)])[0]
    expected = 0.0
    for d, o in zip(data, out["loss_fn_outputs"], strict=True):
        assert len(o["logprobs"]) == len(d["model_input"]) and all(lp < 0 for lp in o["logprobs"])
        expected -= sum(w * lp for w, lp in zip(d["loss_fn_inputs"]["weights"], o["logprobs"], strict=True))
    assert out["metrics"]["loss:sum"] == pytest.approx(expected, rel=1e-5)  # a sum, not a mean


def test_policy_gradient_losses_follow_tinker_formulas(engine: Engine) -> None:
    n = 9
    g = torch.Generator().manual_seed(3)
    base = {"model_input": list(range(20, 20 + n)), "loss_fn_inputs": {"target_tokens": list(range(21, 21 + n))}}
    lp = torch.tensor(
        engine.forward_backward([("a", [base], "cross_entropy", None, True)])[0]["loss_fn_outputs"][0]["logprobs"]
    )
    sampling = lp + 0.3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    inputs = {**base["loss_fn_inputs"], "logprobs": sampling.tolist(), "advantages": adv.tolist()}
    ratio = torch.exp(lp - sampling)
    expected = {
        "importance_sampling": -(ratio * adv).sum(),
        "ppo": -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum(),
        "cispo": -(ratio.clamp(0.8, 1.2) * lp * adv).sum(),
    }
    for name, value in expected.items():
        out = engine.forward_backward(
            [("a", [{"model_input": base["model_input"], "loss_fn_inputs": inputs}], name, None, True)]
        )[0]
        assert out["metrics"]["loss:sum"] == pytest.approx(value.item(), rel=1e-4, abs=1e-5), name
        assert out["loss_fn_outputs"][0]["logprobs"] == lp.tolist()
    tight = engine.forward_backward(
        [
            (
                "a",
                [{"model_input": base["model_input"], "loss_fn_inputs": inputs}],
                "ppo",
                {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
                True,
            )
        ]
    )[0]
    expected_tight = -torch.minimum(ratio * adv, ratio.clamp(0.95, 1.05) * adv).sum()
    assert tight["metrics"]["loss:sum"] == pytest.approx(expected_tight.item(), rel=1e-4, abs=1e-5)
    assert set(LOSSES) >= {"cross_entropy", "importance_sampling", "ppo", "cispo"}


def test_mixed_losses_share_one_batch(engine: Engine) -> None:
    ce = [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1, 1, 1]}}]
    is_ = [
        {
            "model_input": [7, 8],
            "loss_fn_inputs": {"target_tokens": [8, 9], "logprobs": [-5.0, -5.0], "advantages": [1.0, -1.0]},
        }
    ]
    together = engine.forward_backward(
        [("a", ce, "cross_entropy", None, True), ("a", is_, "importance_sampling", None, True)]
    )
    apart = [
        engine.forward_backward([("a", d, fn, None, True)])[0]
        for d, fn in ((ce, "cross_entropy"), (is_, "importance_sampling"))
    ]
    for t, a in zip(together, apart, strict=True):
        assert t["metrics"]["loss:sum"] == pytest.approx(a["metrics"]["loss:sum"], abs=1e-5)
