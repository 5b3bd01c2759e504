"""BatchPlan -> engine calls. One request's error becomes that request's Outcome and never fails the others."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from loraplex.dispatch.plan import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.errors import EngineError, InvalidRequestError, LoraplexError
from loraplex.workers.batching import PreparedItem
from loraplex.workers.engine import Engine

log = logging.getLogger(__name__)

# What a create payload may leave out (the gateway normally fills both): alpha = 2 x rank, as the API's default.
DEFAULT_ALPHA_PER_RANK = 2.0
DEFAULT_SEED = 0


def _error(request: PlannedRequest, exc: BaseException) -> Outcome:
    if not isinstance(exc, LoraplexError):
        # A bug or a device failure: keep the worker alive, report it for the request(s) it hit, and log the trace.
        log.exception("request %s (%s) failed", request.request_id, request.kind, exc_info=exc)
        exc = EngineError(f"{type(exc).__name__}: {exc}")
    return Outcome(request.request_id, error_type=type(exc).__name__, error=str(exc))


class PlanExecutor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._handlers: dict[StepKind, Callable[[Step], list[Outcome]]] = {
            StepKind.CREATE: self._create,
            StepKind.DELETE: self._delete,
            StepKind.FORWARD_BACKWARD: self._forward_backward,
            StepKind.OPTIM_STEP: self._optim_step,
        }

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        """Run the steps in order; outcomes in the order of `plan.requests`."""
        outcomes: list[Outcome] = []
        for step in plan.steps:
            outcomes.extend(self._handlers[step.kind](step))
        return outcomes

    def _one_by_one(self, step: Step, call: Callable[[PlannedRequest], dict[str, Any]]) -> list[Outcome]:
        outcomes = []
        for request in step.requests:
            try:
                outcomes.append(Outcome(request.request_id, result=call(request)))
            except Exception as exc:  # noqa: BLE001 - reported per request, see _error
                outcomes.append(_error(request, exc))
        return outcomes

    def _create(self, step: Step) -> list[Outcome]:
        def create(request: PlannedRequest) -> dict[str, Any]:
            p = request.payload
            if "rank" not in p:
                raise InvalidRequestError("create_adapter needs a rank")
            modules = p.get("target_modules")
            if modules is not None and set(modules) != set(self.engine.target_modules):
                raise InvalidRequestError(
                    f"target_modules {sorted(modules)} differ from this pool's {sorted(self.engine.target_modules)}"
                )
            alpha = p.get("alpha")
            if alpha is None and isinstance(p["rank"], int):
                alpha = DEFAULT_ALPHA_PER_RANK * p["rank"]
            self.engine.create_adapter(request.model_id, p["rank"], alpha, p.get("seed", DEFAULT_SEED))
            return {"model_id": request.model_id}

        return self._one_by_one(step, create)

    def _delete(self, step: Step) -> list[Outcome]:
        def delete(request: PlannedRequest) -> dict[str, Any]:
            self.engine.delete_adapter(request.model_id)
            return {}

        return self._one_by_one(step, delete)

    def _forward_backward(self, step: Step) -> list[Outcome]:
        """Validate each request alone, then run every valid one in a single mixed batch."""
        outcomes: dict[str, Outcome] = {}
        valid: list[tuple[PlannedRequest, PreparedItem]] = []
        for request in step.requests:
            p = request.payload
            forward_only = request.kind == RequestKind.FORWARD or bool(p.get("forward_only", False))
            try:
                item = self.engine.prepare(
                    request.model_id,
                    p.get("data") or [],
                    p.get("loss_fn", "cross_entropy"),
                    p.get("loss_fn_config"),
                    forward_only,
                )
                valid.append((request, item))
            except Exception as exc:  # noqa: BLE001
                outcomes[request.request_id] = _error(request, exc)
        if valid:
            try:
                results = self.engine.forward_backward([item for _, item in valid])
                for (request, _), result in zip(valid, results, strict=True):
                    outcomes[request.request_id] = Outcome(request.request_id, result=result)
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: every request in it gets the error
                for request, _ in valid:
                    outcomes[request.request_id] = _error(request, exc)
        return [outcomes[r.request_id] for r in step.requests]

    def _optim_step(self, step: Step) -> list[Outcome]:
        try:
            results = self.engine.optim_step([(r.model_id, r.payload.get("adam_params")) for r in step.requests])
        except Exception as exc:  # noqa: BLE001
            return [_error(r, exc) for r in step.requests]
        return [
            _error(r, res) if isinstance(res, BaseException) else Outcome(r.request_id, result=res)
            for r, res in zip(step.requests, results, strict=True)
        ]
