"""The typed result of each request kind: what the engine answers, the result store keeps and the gateway returns.
Frozen dataclasses, stdlib only (the worker ranks build them). `to_wire` is the JSON form, the same the HTTP routes
answer (key order included: clients see these bodies byte for byte); `from_wire` reads it back from the result store.
Lists of tokens and logprobs are handed over as they are, never copied (a forward_backward result carries one logprob
per token). Each result type names itself in the store (`RESULT_NAME`), so a stored result is decoded without knowing
its request's kind; the kind table (protocol/kinds.py) names each kind's result type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Result")


@dataclass(frozen=True)
class Result(ABC):
    RESULT_NAME: ClassVar[str] = "result"

    @classmethod
    @abstractmethod
    def from_wire(cls: type[R], data: Mapping[str, Any]) -> R:
        """The result from its JSON form."""

    @abstractmethod
    def to_wire(self) -> dict[str, Any]:
        """The JSON form (what the HTTP routes answer)."""

    def expect(self, cls: type[R]) -> R:
        """This result as `cls` (TypeError when it is another kind's: a request id read as the wrong kind)."""
        if not isinstance(self, cls):
            raise TypeError(f"expected a {cls.__name__}, got a {type(self).__name__}")
        return self


@dataclass(frozen=True)
class CreateResult(Result):
    RESULT_NAME: ClassVar[str] = "create_adapter"
    model_id: str

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CreateResult:
        return cls(model_id=data["model_id"])

    def to_wire(self) -> dict[str, Any]:
        return {"model_id": self.model_id}


@dataclass(frozen=True)
class DeleteResult(Result):
    RESULT_NAME: ClassVar[str] = "delete_adapter"

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> DeleteResult:
        return cls()

    def to_wire(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class LossFnOutput:
    """One datum's outputs: the logprob of each target token."""

    logprobs: list[float]

    def to_wire(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs}


@dataclass(frozen=True)
class ForwardBackwardResult(Result):
    """forward_backward and forward: per-datum outputs, and the loss's metrics keyed `name:reduction` (loss:sum...).
    A metric may be None: a non-finite number is stored as JSON null."""

    RESULT_NAME: ClassVar[str] = "forward_backward"
    loss_fn_outputs: tuple[LossFnOutput, ...] = ()
    metrics: dict[str, float | None] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ForwardBackwardResult:
        outputs = tuple(LossFnOutput(o["logprobs"]) for o in data.get("loss_fn_outputs") or ())
        return cls(loss_fn_outputs=outputs, metrics=dict(data.get("metrics") or {}))

    def to_wire(self) -> dict[str, Any]:
        return {"loss_fn_outputs": [o.to_wire() for o in self.loss_fn_outputs], "metrics": self.metrics}

    @property
    def loss_sum(self) -> float:
        """The loss summed over the target tokens (ValueError when it was not finite)."""
        value = self.metrics["loss:sum"]
        if value is None:
            raise ValueError("loss:sum was not finite")
        return float(value)


@dataclass(frozen=True)
class PartDone(Result):
    """Not a request's answer: a forward_backward part that leaves datums for later plans went well (datums
    [start, stop) of its payload). Never stored: the request stays pending until its last part answers for all."""

    RESULT_NAME: ClassVar[str] = "part"
    part: tuple[int, int]

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PartDone:
        start, stop = data["part"]
        return cls(part=(int(start), int(stop)))

    def to_wire(self) -> dict[str, Any]:
        return {"part": list(self.part)}


@dataclass(frozen=True)
class OptimStepResult(Result):
    """The update's metrics (grad_norm:mean, learning_rate:mean)."""

    RESULT_NAME: ClassVar[str] = "optim_step"
    metrics: dict[str, float | None] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> OptimStepResult:
        return cls(metrics=dict(data.get("metrics") or {}))

    def to_wire(self) -> dict[str, Any]:
        return {"metrics": self.metrics}


@dataclass(frozen=True)
class SaveResult(Result):
    """save_state and save_sampler: the checkpoint's tinker path, its kind (weights / sampler_weights), name and the
    adapter's optimizer step; its files' size and hash once written (None before a background write finished, and on
    ranks that do not write)."""

    RESULT_NAME: ClassVar[str] = "save"
    path: str | None
    kind: str
    name: str | None
    step: int
    size_bytes: int | None = None
    sha256: str | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SaveResult:
        return cls(
            path=data.get("path"),
            kind=data["kind"],
            name=data.get("name"),
            step=int(data["step"]),
            size_bytes=data.get("size_bytes"),
            sha256=data.get("sha256"),
        )

    @property
    def tinker_path(self) -> str:
        """The checkpoint's tinker:// path (every save the gateway queues names one)."""
        if self.path is None:
            raise ValueError("this save named no tinker path")
        return self.path

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"path": self.path, "kind": self.kind, "name": self.name, "step": self.step}
        if self.size_bytes is not None:  # absent, not null, until the files are written
            wire["size_bytes"] = self.size_bytes
        if self.sha256 is not None:
            wire["sha256"] = self.sha256
        return wire


@dataclass(frozen=True)
class LoadResult(Result):
    RESULT_NAME: ClassVar[str] = "load_state"
    model_id: str
    path: str | None
    with_optimizer: bool

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> LoadResult:
        return cls(model_id=data["model_id"], path=data.get("path"), with_optimizer=bool(data["with_optimizer"]))

    def to_wire(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "path": self.path, "with_optimizer": self.with_optimizer}


@dataclass(frozen=True)
class SampledSequence:
    """One sample: its tokens, their logprobs, why it stopped ("stop" or "length"), and per token the top-k
    (token id, logprob) pairs when asked."""

    tokens: list[int]
    logprobs: list[float] | None  # None only from a backend that was asked for none
    stop_reason: str
    topk_logprobs: list[list[tuple[int, float]]] | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SampledSequence:
        topk = data.get("topk_logprobs")
        return cls(
            tokens=data["tokens"],
            logprobs=data["logprobs"],
            stop_reason=data["stop_reason"],
            topk_logprobs=None if topk is None else [[(int(t), lp) for t, lp in row] for row in topk],
        )

    def to_wire(self) -> dict[str, Any]:
        topk = self.topk_logprobs
        return {
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "stop_reason": self.stop_reason,
            "topk_logprobs": None if topk is None else [[list(pair) for pair in row] for row in topk],
        }


@dataclass(frozen=True)
class SampleResult(Result):
    """The samples, and the prompt's logprobs (and top-k pairs per prompt token) when asked."""

    RESULT_NAME: ClassVar[str] = "sample"
    sequences: tuple[SampledSequence, ...] = ()
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SampleResult:
        topk = data.get("topk_prompt_logprobs")
        return cls(
            sequences=tuple(SampledSequence.from_wire(s) for s in data.get("sequences") or ()),
            prompt_logprobs=data.get("prompt_logprobs"),
            topk_prompt_logprobs=None
            if topk is None
            else [None if row is None else [(int(t), lp) for t, lp in row] for row in topk],
        )

    def to_wire(self) -> dict[str, Any]:
        topk = self.topk_prompt_logprobs
        return {
            "sequences": [s.to_wire() for s in self.sequences],
            "prompt_logprobs": self.prompt_logprobs,
            "topk_prompt_logprobs": None
            if topk is None
            else [None if row is None else [list(pair) for pair in row] for row in topk],
        }

    @property
    def num_tokens(self) -> int:
        """Tokens sampled, over all sequences."""
        return sum(len(s.tokens) for s in self.sequences)


@dataclass(frozen=True)
class RejectedResult(Result):
    """The `rejected` kind's row names this for completeness: a rejected request always fails (with the error the
    gateway gave), so no outcome ever carries one."""

    RESULT_NAME: ClassVar[str] = "rejected"

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RejectedResult:
        return cls()

    def to_wire(self) -> dict[str, Any]:
        return {}


RESULT_TYPES: dict[str, type[Result]] = {
    cls.RESULT_NAME: cls
    for cls in (
        CreateResult,
        DeleteResult,
        ForwardBackwardResult,
        PartDone,
        OptimStepResult,
        SaveResult,
        LoadResult,
        SampleResult,
        RejectedResult,
    )
}


def result_from_wire(name: str, data: Mapping[str, Any]) -> Result:
    """A stored result from its type's name and JSON form; ValueError for a name no result type has."""
    cls = RESULT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"no result type {name!r}")
    return cls.from_wire(data)
