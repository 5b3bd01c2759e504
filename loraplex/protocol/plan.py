"""What the dispatcher hands the worker ranks, and what comes back: pure data, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.protocol.kinds import RequestKind, StepKind, parse_payload
from loraplex.protocol.payloads import ForwardBackwardPayload, Payload


@dataclass(frozen=True)
class PlannedRequest:
    """One accepted request. `payload` is the kind's payload model (protocol/payloads.py); a mapping given here is
    parsed into it."""

    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: RequestKind
    payload: Payload | Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RequestKind(self.kind))
        object.__setattr__(self, "payload", parse_payload(self.kind, self.payload))

    @property
    def num_tokens(self) -> int:
        p = self.payload
        return p.num_tokens if isinstance(p, ForwardBackwardPayload) else 0


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


class Executor(Protocol):
    """Runs a plan on the pool (workers/executor.PlanExecutor, or the leader's broadcast wrapper); one Outcome per
    request, in the order of `plan.requests`."""

    def execute(self, plan: BatchPlan) -> list[Outcome]: ...
