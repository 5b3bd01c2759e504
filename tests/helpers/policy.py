"""Builders for the dispatch.policy tests: request kinds, planned requests, a plan's steps as (kind, [(model, seq)])."""

from __future__ import annotations

import itertools

from loraplex.dispatch.policy import PolicyLimits, PolicyResult, plan_batch
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, StepKind

FB, FWD, OPT = RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD, RequestKind.OPTIM_STEP
CREATE, DELETE = RequestKind.CREATE_ADAPTER, RequestKind.DELETE_ADAPTER
REJECTED = RequestKind.REJECTED
SAMPLE = RequestKind.SAMPLE
_ids = itertools.count()


def req(
    model: str, seq: int, kind: RequestKind = FB, tokens: int = 8, tenant: str | None = None, datums: int = 1
) -> PlannedRequest:
    """`datums` datums of `tokens` tokens each for forward_backward / forward."""
    payload: dict = {}
    if kind in (FB, FWD):
        data = [{"model_input": [0] * tokens, "loss_fn_inputs": {}} for _ in range(datums)]
        payload = {"data": data, "loss_fn": "cross_entropy"}
    elif kind == SAMPLE:
        payload = {"prompt": [1] * tokens, "num_samples": datums, "max_tokens": 4}
    elif kind == REJECTED:
        payload = {"rejected_kind": "forward_backward", "message": "loss_fn: Input should be 'cross_entropy'"}
    return PlannedRequest(f"r{next(_ids)}", tenant or f"t-{model}", model, seq, kind, payload)


def steps(plan: BatchPlan) -> list[tuple[StepKind, list[tuple[str, int]]]]:
    return [(s.kind, [(r.model_id, r.seq_id) for r in s.requests]) for s in plan.steps]


def run(pending, last=None, progress=None, **limits) -> PolicyResult:
    return plan_batch(pending, last or {}, PolicyLimits(**limits), progress)
