"""What the dispatcher hands the worker ranks, and what comes back: pure data, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.errors import EngineError, LoraplexError, error_class, error_name
from loraplex.protocol.kinds import RequestKind, StepKind, parse_payload, tokens_of
from loraplex.protocol.payloads import ForwardBackwardPayload, Payload
from loraplex.protocol.results import Result


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
        """Its tokens by its kind's row (protocol/kinds.py): input tokens of forward_backward / forward (its part's,
        when it is a part), a sample's prompt plus the most it can add, 0 for the other kinds."""
        return tokens_of(self.kind, self.payload, self.part)  # type: ignore[arg-type]

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
    """The result of one request: `result` (its kind's typed result, protocol/results.py) on success, else `error_type`
    (a loraplex.errors class; stored and answered as its registered name) and `error` (the message). Build a failed
    one with `Outcome.failed`."""

    request_id: str
    result: Result | None = None
    error_type: type[LoraplexError] | None = None
    error: str | None = None
    # Not answered yet: the work goes on in later plans (a sample run in slices, workers/sampling/step.py); the
    # request stays pending (no result stored, no ack) until an outcome without it comes.
    unfinished: bool = False

    @classmethod
    def failed(cls, request_id: str, exc: BaseException, message: str | None = None) -> Outcome:
        """The outcome of a request that failed with `exc`: its class as registered (loraplex.errors.error_name) and
        its message (`message` instead, when given); an exception outside loraplex.errors as an EngineError naming
        its type."""
        if isinstance(exc, LoraplexError):
            error_type = error_class(error_name(type(exc)))
            return cls(request_id, error_type=error_type, error=str(exc) if message is None else message)
        return cls(request_id, error_type=EngineError, error=f"{type(exc).__name__}: {exc}" if message is None else message)

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @property
    def error_name(self) -> str | None:
        """The error's wire name (None on success)."""
        return None if self.error_type is None else error_name(self.error_type)

    def exception(self, default_message: str = "") -> LoraplexError:
        """The error as an exception to raise (a failed outcome only); `default_message` when it has none."""
        assert self.error_type is not None, "a successful outcome has no error"
        return self.error_type(self.error or default_message)


class Executor(Protocol):
    """Runs a plan on the pool (workers/executor.PlanExecutor, or the leader's broadcast wrapper); one Outcome per
    request, in the order of `plan.requests`."""

    def execute(self, plan: BatchPlan) -> list[Outcome]: ...
