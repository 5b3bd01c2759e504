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
    # A forward_backward / forward request too large for one plan runs in parts: datums [start, stop) of its payload
    # in this plan (the payload stays whole; its gradient accumulates over the parts, and the last answers for all).
    part: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RequestKind(self.kind))
        object.__setattr__(self, "payload", parse_payload(self.kind, self.payload))

    @property
    def num_tokens(self) -> int:
        """Input tokens this plan runs of it (its part's, when it is a part)."""
        p = self.payload
        if not isinstance(p, ForwardBackwardPayload):
            return 0
        data = p.data if self.part is None else p.data[self.part[0] : self.part[1]]
        return sum(len(d.model_input) for d in data)

    @property
    def unfinished(self) -> bool:
        """A part that leaves datums for later plans: the request is not answered (nor its seq_id applied) yet."""
        p = self.payload
        return self.part is not None and isinstance(p, ForwardBackwardPayload) and self.part[1] < len(p.data)


@dataclass(frozen=True)
class Step:
    """One engine call. For FORWARD_BACKWARD the requests are ordered so that each adapter's rows are contiguous."""

    kind: StepKind
    requests: tuple[PlannedRequest, ...]
    # SAMPLE only: the most seconds of sampling this step may run (the dispatcher sets it to the seconds its plan's
    # training took, so sampling beside training takes at most half the pool's time); None: the sampler's own slice.
    seconds: float | None = None


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
    # Not answered yet: the work goes on in later plans (a sample run in slices, workers/sampling/step.py); the
    # request stays pending (no result stored, no ack) until an outcome without it comes.
    unfinished: bool = False

    @property
    def ok(self) -> bool:
        return self.error_type is None


class Executor(Protocol):
    """Runs a plan on the pool (workers/executor.PlanExecutor, or the leader's broadcast wrapper); one Outcome per
    request, in the order of `plan.requests`."""

    def execute(self, plan: BatchPlan) -> list[Outcome]: ...
