"""PlanExecutor: steps -> engine calls; each request's error stays its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine import Engine
from loraplex.workers.executor import PlanExecutor


@pytest.fixture
def executor(tiny_dir: Path) -> PlanExecutor:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return PlanExecutor(Engine(model, num_slots=2, max_rank=8))


def req(rid: str, model_id: str, kind: RequestKind, **payload) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


DATA = [{"model_input": [1, 2, 3, 4], "loss_fn_inputs": {"target_tokens": [2, 3, 4, 5], "weights": [1, 1, 1, 1]}}]


def test_plan_runs_steps_in_order_with_per_request_errors(executor: PlanExecutor) -> None:
    plan = BatchPlan(
        steps=(
            Step(
                StepKind.CREATE,
                (
                    req("c1", "a", RequestKind.CREATE_ADAPTER, rank=4, alpha=8.0, seed=1),
                    req("c2", "b", RequestKind.CREATE_ADAPTER, rank=64, alpha=8.0, seed=1),  # above max_rank
                    req("c3", "b2", RequestKind.CREATE_ADAPTER, rank=2, seed=2),  # alpha defaults to 2 x rank
                    req("c4", "b3", RequestKind.CREATE_ADAPTER, rank=2, target_modules=["q_proj"]),
                ),
            ),
            Step(
                StepKind.FORWARD_BACKWARD,
                (
                    req("f1", "a", RequestKind.FORWARD_BACKWARD, data=DATA, loss_fn="cross_entropy"),
                    req(
                        "f2",
                        "a",
                        RequestKind.FORWARD_BACKWARD,
                        data=[{"model_input": [999999], "loss_fn_inputs": {"target_tokens": [1]}}],
                    ),
                    req("f3", "b2", RequestKind.FORWARD, data=DATA, loss_fn="cross_entropy"),
                    req("f4", "ghost", RequestKind.FORWARD_BACKWARD, data=DATA),
                    req("f5", "b2", RequestKind.FORWARD_BACKWARD, data=DATA, loss_fn="nope"),
                ),
            ),
            Step(
                StepKind.OPTIM_STEP,
                (
                    req("o1", "a", RequestKind.OPTIM_STEP, adam_params={"learning_rate": 1e-3}),
                    req("o2", "ghost", RequestKind.OPTIM_STEP),
                ),
            ),
            Step(
                StepKind.REJECT,
                (req("x1", "a", RequestKind.REJECTED, rejected_kind="optim_step", message="adam_params.eps: > 0"),),
            ),
            Step(
                StepKind.DELETE,
                (req("d1", "a", RequestKind.DELETE_ADAPTER), req("d2", "a", RequestKind.DELETE_ADAPTER)),
            ),
        )
    )
    outcomes = executor.execute(plan)
    by_id = {o.request_id: o for o in outcomes}
    assert [o.request_id for o in outcomes] == [r.request_id for r in plan.requests]
    assert by_id["c1"].result == {"model_id": "a"} and by_id["c3"].ok
    assert executor.engine.adapter("b2").alpha == 4.0
    assert by_id["c4"].error_type == "InvalidRequestError" and "target_modules" in by_id["c4"].error
    assert by_id["c2"].error_type == "InvalidRequestError" and "rank" in by_id["c2"].error
    assert by_id["f1"].ok and by_id["f1"].result["metrics"]["loss:sum"] > 0
    assert len(by_id["f1"].result["loss_fn_outputs"][0]["logprobs"]) == 4
    assert by_id["f2"].error_type == "InvalidRequestError"
    assert (
        by_id["f3"].ok and by_id["f4"].error_type == "NotFoundError" and by_id["f5"].error_type == "InvalidRequestError"
    )
    assert by_id["o1"].ok and by_id["o1"].result["metrics"]["grad_norm:mean"] > 0
    assert by_id["o2"].error_type == "NotFoundError"
    assert (by_id["x1"].error_type, by_id["x1"].error) == (
        "InvalidRequestError", "the gateway rejected this optim_step: adam_params.eps: > 0"
    )  # fmt: skip
    assert by_id["d1"].result == {} and by_id["d2"].error_type == "NotFoundError"
    # f3 was forward-only: b2 got no gradient
    grads = executor.engine.adapter_grads("b2")
    assert all(g.abs().sum() == 0 for pair in grads.values() for g in pair)


def test_an_unexpected_failure_becomes_engine_errors(executor: PlanExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    executor.engine.create_adapter("a", 4, 8.0, seed=1)

    def boom(items):
        raise RuntimeError("device lost")

    monkeypatch.setattr(executor.engine, "forward_backward", boom)
    step = Step(
        StepKind.FORWARD_BACKWARD,
        (req("f1", "a", RequestKind.FORWARD_BACKWARD, data=DATA), req("f2", "a", RequestKind.FORWARD, data=DATA)),
    )
    outcomes = executor.execute(BatchPlan(steps=(step,)))
    assert [o.error_type for o in outcomes] == ["EngineError", "EngineError"]
    assert "device lost" in outcomes[0].error
