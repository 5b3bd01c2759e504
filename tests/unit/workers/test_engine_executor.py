"""PlanExecutor: steps -> engine calls; each request's error stays its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import CreateResult, DeleteResult, ForwardBackwardResult, OptimStepResult, PartDone
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor


@pytest.fixture
def executor(tiny_dir: Path) -> PlanExecutor:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return PlanExecutor(build_engine(model, EngineConfig(num_slots=2, max_rank=8)))


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
                    req("c4", "b3", RequestKind.CREATE_ADAPTER, rank=2, target_modules=["q_proj", "w_proj"]),
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
    assert by_id["c1"].result == CreateResult("a") and by_id["c3"].ok
    assert executor.engine.adapter("b2").alpha == 4.0
    assert by_id["c4"].error_name == "InvalidRequestError" and "target_modules" in by_id["c4"].error
    assert by_id["c2"].error_name == "InvalidRequestError" and "rank" in by_id["c2"].error
    assert by_id["f1"].ok and by_id["f1"].result.expect(ForwardBackwardResult).loss_sum > 0
    assert len(by_id["f1"].result.expect(ForwardBackwardResult).loss_fn_outputs[0].logprobs) == 4
    assert by_id["f2"].error_name == "InvalidRequestError"
    assert (
        by_id["f3"].ok and by_id["f4"].error_name == "NotFoundError" and by_id["f5"].error_name == "InvalidRequestError"
    )
    assert by_id["o1"].ok and by_id["o1"].result.expect(OptimStepResult).metrics["grad_norm:mean"] > 0
    assert by_id["o2"].error_name == "NotFoundError"
    assert (by_id["x1"].error_name, by_id["x1"].error) == (
        "InvalidRequestError", "the gateway rejected this optim_step: adam_params.eps: > 0"
    )  # fmt: skip
    assert by_id["d1"].result == DeleteResult() and by_id["d2"].error_name == "NotFoundError"
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
    assert [o.error_name for o in outcomes] == ["EngineError", "EngineError"]
    assert "device lost" in outcomes[0].error


def test_a_request_run_in_parts_equals_it_run_whole(tiny_dir: Path) -> None:
    """The same importance_sampling request on two fresh engines: whole in one plan, and in three parts over three
    plans (as the policy splits one over the token cap). Same gradients, every datum's logprobs in order, loss:sum,
    and the loss's metrics over all datums; only the last part answers with a result."""
    import random

    import torch

    from loraplex.models import load_base_model

    rng = random.Random(3)
    data = []
    for n in (5, 7, 3, 6, 4):
        ids = [rng.randrange(1, 200) for _ in range(n)]
        data.append({"model_input": ids, "loss_fn_inputs": {"target_tokens": ids[1:] + [1], "logprobs": [-1.5] * n,
                                                            "advantages": [rng.uniform(-1, 1) for _ in range(n)]}})  # fmt: skip
    executors = []
    for _ in range(2):
        torch.manual_seed(0)
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
        ex = PlanExecutor(build_engine(model, EngineConfig(num_slots=2, max_rank=8)))  # fp32 on the CPU
        ex.engine.create_adapter("a", 4, 8.0, seed=5)
        executors.append(ex)
    whole_ex, parts_ex = executors
    request = req("f", "a", RequestKind.FORWARD_BACKWARD, data=data, loss_fn="importance_sampling")
    (whole,) = whole_ex.execute(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (request,)),)))
    answers = []
    for part in ((0, 2), (2, 4), (4, 5)):
        piece = PlannedRequest(request.request_id, "t", "a", 0, RequestKind.FORWARD_BACKWARD, request.payload, part)
        (answer,) = parts_ex.execute(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (piece,)),)))
        answers.append(answer)
    assert [a.result for a in answers[:2]] == [PartDone((0, 2)), PartDone((2, 4))]
    assert whole.ok and answers[-1].result is not None and whole.result is not None
    last, first = answers[-1].result.expect(ForwardBackwardResult), whole.result.expect(ForwardBackwardResult)
    assert [len(o.logprobs) for o in last.loss_fn_outputs] == [5, 7, 3, 6, 4]
    for got, want in zip(last.loss_fn_outputs, first.loss_fn_outputs, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert last.metrics.keys() == first.metrics.keys()
    for name, value in first.metrics.items():
        assert last.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for name, (ga, gb) in whole_ex.engine.adapter_grads("a").items():
        pa, pb = parts_ex.engine.adapter_grads("a")[name]
        torch.testing.assert_close(pa, ga, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pb, gb, rtol=1e-5, atol=1e-6)
    assert parts_ex._parts == {}


def test_a_bad_datum_in_a_later_part_fails_the_request_at_its_first_part(executor: PlanExecutor) -> None:
    executor.engine.create_adapter("a", 4, 8.0, seed=1)
    bad = [*DATA, {"model_input": [999999], "loss_fn_inputs": {"target_tokens": [1]}}]
    request = req("f", "a", RequestKind.FORWARD_BACKWARD, data=bad)
    first = PlannedRequest(request.request_id, "t", "a", 0, RequestKind.FORWARD_BACKWARD, request.payload, (0, 1))
    (outcome,) = executor.execute(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (first,)),)))
    assert outcome.error_name == "InvalidRequestError" and executor._parts == {}
    assert all(g.abs().sum() == 0 for pair in executor.engine.adapter_grads("a").values() for g in pair)


def test_a_pool_without_a_sampler_fails_its_sampling_requests_alone(executor: PlanExecutor) -> None:
    plan = BatchPlan((
        Step(StepKind.CREATE, (req("c", "m", RequestKind.CREATE_ADAPTER, rank=2, alpha=4.0, seed=1),)),
        Step(StepKind.SAMPLE, (PlannedRequest("s", "t", "session", 0, RequestKind.SAMPLE, {"prompt": [1, 2]}),)),
    ))  # fmt: skip
    created, sampled = executor.execute(plan)
    assert created.ok and not sampled.ok
    assert sampled.error_name == "NotSupportedError" and "no sampler" in (sampled.error or "")


def test_on_step_is_told_each_steps_outcomes_and_seconds(tiny_dir: Path) -> None:
    """The pool's cost model calibrates from these (dispatch/cost_calibration.OnlineCostModel.observe_step)."""
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    seen: list[tuple[StepKind, list[str], float]] = []
    executor = PlanExecutor(build_engine(model, EngineConfig(num_slots=2, max_rank=8)),
                            on_step=lambda step, outcomes, s: seen.append((step.kind, [o.request_id for o in outcomes], s)))  # fmt: skip
    plan = BatchPlan((
        Step(StepKind.CREATE, (req("c", "a", RequestKind.CREATE_ADAPTER, rank=4, seed=1),)),
        Step(StepKind.FORWARD_BACKWARD, (req("f", "a", RequestKind.FORWARD_BACKWARD, data=DATA),)),
    ))  # fmt: skip
    assert all(o.ok for o in executor.execute(plan))
    assert [(k, ids) for k, ids, _ in seen] == [(StepKind.CREATE, ["c"]), (StepKind.FORWARD_BACKWARD, ["f"])]
    assert all(s > 0 for _, _, s in seen)
