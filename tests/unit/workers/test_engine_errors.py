"""Bad input is refused with typed errors before anything runs; capacity and identity errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.errors import CapacityError, ConflictError, EngineError, InvalidRequestError, NotFoundError
from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from tests.helpers.datums import datums, with_datums


@pytest.fixture
def engine(tiny_dir: Path) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    e = build_engine(model, EngineConfig(num_slots=2, max_rank=8))
    e.create_adapter("a", 4, 8.0, seed=0)
    return e


def datum(tokens=(1, 2, 3), targets=(2, 3, 4), weights=(1.0, 1.0, 1.0), **extra) -> dict:
    inputs = {"target_tokens": list(targets), **extra}
    if weights is not None:
        inputs["weights"] = list(weights)
    return {"model_input": list(tokens), "loss_fn_inputs": inputs}


@pytest.mark.parametrize(
    ("data", "loss_fn", "match"),
    [
        ([datum(tokens=(1, 512, 3))], "cross_entropy", "out of range"),
        ([datum(tokens=(1, -1, 3))], "cross_entropy", "out of range"),
        ([datum(targets=(2, 3, 9999))], "cross_entropy", "out of range"),
        ([datum(targets=(2, 3))], "cross_entropy", "target_tokens length"),
        ([datum(weights=(1.0, 1.0))], "cross_entropy", "weights: length"),
        ([datum(weights=(1.0, float("nan"), 1.0))], "cross_entropy", "NaN"),
        ([datum(tokens=(), targets=())], "cross_entropy", "non-empty"),
        ([datum(targets=(2.5, 3, 4))], "cross_entropy", "integers"),
        ([], "cross_entropy", "data is empty"),
        ([{"model_input": [1, 2]}], "cross_entropy", "target_tokens is required"),
        ([datum()], "kl_magic", "unknown loss_fn"),
        ([datum(logprobs=[0.0, 0.0, 0.0])], "importance_sampling", "advantages is required"),
        ([datum(), datum(targets=(1,))], "cross_entropy", r"data\[1\]"),
    ],
)
def test_bad_forward_backward_input(engine: Engine, data: list, loss_fn: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        engine.forward_backward([engine.prepare("a", datums(data), loss_fn, None, False)])
    assert isinstance(info.value, ValueError)  # the stdlib cousin


def test_a_bad_item_fails_the_call_before_any_gradient(engine: Engine) -> None:
    good = ("a", [datum()], "cross_entropy", None, False)
    with pytest.raises(InvalidRequestError):
        engine.forward_backward(
            [
                engine.prepare(*with_datums(good)),
                engine.prepare("a", datums([datum(tokens=(1, 2, 999))]), "cross_entropy", None, False),
            ]
        )
    assert all(torch.count_nonzero(g) == 0 for pair in engine.adapter_grads("a").values() for g in pair)


def test_weights_default_to_one_for_cross_entropy(engine: Engine) -> None:
    with_w = engine.forward_backward([engine.prepare("a", datums([datum()]), "cross_entropy", None, True)])[0]
    without = engine.forward_backward(
        [engine.prepare("a", datums([datum(weights=None)]), "cross_entropy", None, True)]
    )[0]
    assert with_w == without


def test_adapter_identity_and_capacity_errors(engine: Engine) -> None:
    with pytest.raises(NotFoundError):
        engine.forward_backward([engine.prepare("ghost", datums([datum()]), "cross_entropy", None, False)])
    with pytest.raises(NotFoundError):
        engine.delete_adapter("ghost")
    with pytest.raises(ConflictError):
        engine.create_adapter("a", 4, 8.0, seed=1)
    for rank, alpha in [(0, 8.0), (9, 8.0), (2.5, 8.0), (4, 0.0), (4, float("inf"))]:
        with pytest.raises(InvalidRequestError):
            engine.create_adapter("bad", rank, alpha, seed=1)
    engine.create_adapter("b", 8, 8.0, seed=1)
    with pytest.raises(CapacityError):
        engine.create_adapter("c", 2, 8.0, seed=1)
    engine.delete_adapter("b")
    engine.create_adapter("c", 2, 8.0, seed=1)  # the freed slot is reusable


def test_optim_step_errors_are_per_item(engine: Engine) -> None:
    engine.create_adapter("b", 4, 8.0, seed=1)
    engine.forward_backward(
        [
            engine.prepare("a", datums([datum()]), "cross_entropy", None, False),
            engine.prepare("b", datums([datum()]), "cross_entropy", None, False),
        ]
    )
    res = engine.optim_step([("ghost", None), ("a", {"learning_rate": -1.0}), ("b", {"learning_rate": 1e-3})])
    assert isinstance(res[0], NotFoundError) and isinstance(res[1], InvalidRequestError)
    assert res[2]["metrics"]["grad_norm:mean"] > 0
    # a's gradients were not consumed by the refused step
    assert any(torch.count_nonzero(g) > 0 for pair in engine.adapter_grads("a").values() for g in pair)
    bank = next(iter(engine.banks.values()))
    bank.lora_B.grad[engine.adapter("a").slot, 0, 0] = float("inf")
    res = engine.optim_step([("a", None), ("b", None)])
    assert isinstance(res[0], EngineError) and "non-finite" in str(res[0]) and "metrics" in res[1]
    assert all(torch.count_nonzero(g) == 0 for pair in engine.adapter_grads("a").values() for g in pair)
