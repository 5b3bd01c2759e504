"""What the dispatcher hands the worker ranks: pure data, no I/O. Shared contract between `dispatch/` and `workers/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class RequestKind(StrEnum):
    CREATE_ADAPTER = "create_adapter"
    DELETE_ADAPTER = "delete_adapter"
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"  # weights + optimizer state -> checkpoint files
    SAVE_SAMPLER = "save_sampler"  # weights only (for sampling / export)
    LOAD_STATE = "load_state"  # checkpoint files -> this (new or existing) adapter


class StepKind(StrEnum):
    CREATE = "create"  # initialise adapters from their seeds
    DELETE = "delete"  # zero slots, drop state
    FORWARD_BACKWARD = "forward_backward"  # one mixed batch; rows of forward-only requests get no gradient
    OPTIM_STEP = "optim_step"  # one batched AdamW update over the requests' adapters
    CHECKPOINT = "checkpoint"  # save_state / save_sampler / load_state requests, one by one, in seq_id order


@dataclass(frozen=True)
class PlannedRequest:
    """One accepted request. `payload` is the decoded body (see queue/envelope.py for each kind's fields)."""

    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: RequestKind
    payload: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(d["model_input"]) for d in self.payload.get("data", ()))


@dataclass(frozen=True)
class Step:
    """One engine call. For FORWARD_BACKWARD the requests are ordered so that each adapter's rows are contiguous."""

    kind: StepKind
    requests: tuple[PlannedRequest, ...]


@dataclass(frozen=True)
class BatchPlan:
    steps: tuple[Step, ...]

    @property
    def requests(self) -> tuple[PlannedRequest, ...]:
        return tuple(r for s in self.steps for r in s.requests)


@dataclass(frozen=True)
class Outcome:
    """The result of one request: `result` on success, else `error_type` + `error` (an errors.py class name)."""

    request_id: str
    result: dict[str, Any] | None = None
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None
