"""The typed payload of each request kind: what the gateway puts in an envelope and the pool reads. Frozen
dataclasses, stdlib only (the worker ranks import this on machines without pydantic); `from_wire` builds one from its
JSON form and raises ValueError naming the field when the shape is wrong. Element checks (token ids, lengths, loss
inputs, Adam ranges) stay with the engine and the gateway; lenient where the worker owns the check (a create without a
rank, a checkpoint step without its folder fail per request in the executor with their own message, as before)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

P = TypeVar("P", bound="Payload")


def _check(value: Any, types: type | tuple[type, ...], name: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"{name}: expected {_names(types)}, got a bool")
    if not isinstance(value, types):
        raise ValueError(f"{name}: expected {_names(types)}, got {type(value).__name__}")
    return value


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


@dataclass(frozen=True)
class Payload(ABC):
    KIND_NAME: ClassVar[str] = "payload"

    @classmethod
    def _fields_of(cls, data: Mapping[str, Any]) -> Mapping[str, Any]:
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.KIND_NAME}: expected an object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{cls.KIND_NAME}: unknown field(s) {', '.join(sorted(unknown))}")
        return data

    @classmethod
    @abstractmethod
    def from_wire(cls: type[P], data: Mapping[str, Any]) -> P:
        """The payload from its JSON form; ValueError naming the field when the shape is wrong."""

    def to_wire(self) -> dict[str, Any]:
        """The JSON form. Shallow: token and weight lists are handed over as they are, not copied (dataclasses.asdict
        deep-copies them: ~7 ms for 8 x 512 tokens on the gateway's hot path)."""
        return {f.name: _wire(getattr(self, f.name)) for f in fields(self)}


def _wire(value: Any) -> Any:
    if isinstance(value, Payload):
        return value.to_wire()
    if isinstance(value, tuple):
        return [_wire(v) for v in value]
    return value


@dataclass(frozen=True)
class FromCheckpoint(Payload):
    """A new adapter restored from a checkpoint folder (the gateway resolved the tenant's tinker path to it)."""

    KIND_NAME: ClassVar[str] = "from_checkpoint"
    directory: str
    path: str | None = None
    with_optimizer: bool | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> FromCheckpoint:
        d = cls._fields_of(data)
        return cls(
            directory=_check(d.get("directory"), str, "from_checkpoint.directory"),
            path=_check(d.get("path"), str, "from_checkpoint.path", optional=True),
            with_optimizer=_check(d.get("with_optimizer"), bool, "from_checkpoint.with_optimizer", optional=True),
        )


@dataclass(frozen=True)
class CreateAdapterPayload(Payload):
    KIND_NAME: ClassVar[str] = "create_adapter"
    base_model: str = ""
    rank: int | None = None  # None: the executor fails the request ("needs a rank")
    alpha: float | None = None  # None: 2 x rank
    seed: int = 0
    target_modules: tuple[str, ...] | None = None
    from_checkpoint: FromCheckpoint | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CreateAdapterPayload:
        d = cls._fields_of(data)
        modules = _check(d.get("target_modules"), (list, tuple), "target_modules", optional=True)
        source = d.get("from_checkpoint")
        return cls(
            base_model=_check(d.get("base_model", ""), str, "base_model"),
            rank=_check(d.get("rank"), int, "rank", optional=True),
            alpha=_check(d.get("alpha"), (int, float), "alpha", optional=True),
            seed=_check(d.get("seed", 0), int, "seed"),
            target_modules=None if modules is None else tuple(_check(m, str, "target_modules[]") for m in modules),
            from_checkpoint=None if source is None else FromCheckpoint.from_wire(source),
        )

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        if self.from_checkpoint is None:
            del wire["from_checkpoint"]  # absent, not null: a plain creation
        return wire


@dataclass(frozen=True)
class DeleteAdapterPayload(Payload):
    KIND_NAME: ClassVar[str] = "delete_adapter"

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> DeleteAdapterPayload:
        cls._fields_of(data)
        return cls()


@dataclass(frozen=True)
class DatumPayload(Payload):
    """One sequence: input tokens, and the loss inputs per position (target_tokens, weights, logprobs, advantages...).
    The lists are kept as sent; the engine checks their elements (workers/engine/batching.py)."""

    KIND_NAME: ClassVar[str] = "datum"
    model_input: list[int]
    loss_fn_inputs: dict[str, list[Any]] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> DatumPayload:
        d = cls._fields_of(data)
        inputs = _check(d.get("loss_fn_inputs", {}), Mapping, "loss_fn_inputs")
        return cls(model_input=_check(d.get("model_input"), list, "model_input"), loss_fn_inputs=dict(inputs))

    def as_engine_input(self) -> dict[str, Any]:
        """The mapping the engine's batching reads (workers/ take plain data)."""
        return {"model_input": self.model_input, "loss_fn_inputs": self.loss_fn_inputs}


@dataclass(frozen=True)
class ForwardBackwardPayload(Payload):
    """forward_backward, and forward (outputs and loss only)."""

    KIND_NAME: ClassVar[str] = "forward_backward"
    data: tuple[DatumPayload, ...] = ()
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, Any] | None = None  # checked by the loss (workers/engine/losses.py)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ForwardBackwardPayload:
        d = cls._fields_of(data)
        datums = _check(d.get("data") or [], (list, tuple), "data")
        config = _check(d.get("loss_fn_config"), Mapping, "loss_fn_config", optional=True)
        return cls(
            data=tuple(x if isinstance(x, DatumPayload) else DatumPayload.from_wire(x) for x in datums),
            loss_fn=_check(d.get("loss_fn", "cross_entropy"), str, "loss_fn"),
            loss_fn_config=None if config is None else dict(config),
        )

    @property
    def num_tokens(self) -> int:
        return sum(len(d.model_input) for d in self.data)


@dataclass(frozen=True)
class OptimStepPayload(Payload):
    KIND_NAME: ClassVar[str] = "optim_step"
    # AdamW hyperparameters by name (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm); the optimizer
    # checks names and ranges per request (None: its defaults).
    adam_params: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> OptimStepPayload:
        d = cls._fields_of(data)
        params = _check(d.get("adam_params"), Mapping, "adam_params", optional=True)
        return cls(adam_params=None if params is None else dict(params))


@dataclass(frozen=True)
class SaveCheckpointPayload(Payload):
    """save_state and save_sampler: the gateway chose the folder in the blob store and the row's fields."""

    KIND_NAME: ClassVar[str] = "save_checkpoint"
    name: str | None = None
    path: str | None = None  # tinker://<model_id>/<segment>/<name>
    directory: str | None = None
    blob_uri: str | None = None
    ttl_seconds: float | None = None
    base_model: str = ""
    overwrite: bool = False

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SaveCheckpointPayload:
        d = cls._fields_of(data)
        return cls(
            name=_check(d.get("name"), str, "name", optional=True),
            path=_check(d.get("path"), str, "path", optional=True),
            directory=_check(d.get("directory"), str, "directory", optional=True),
            blob_uri=_check(d.get("blob_uri"), str, "blob_uri", optional=True),
            ttl_seconds=_check(d.get("ttl_seconds"), (int, float), "ttl_seconds", optional=True),
            base_model=_check(d.get("base_model", ""), str, "base_model"),
            overwrite=_check(d.get("overwrite", False), bool, "overwrite"),
        )


@dataclass(frozen=True)
class LoadStatePayload(Payload):
    KIND_NAME: ClassVar[str] = "load_state"
    path: str | None = None
    directory: str | None = None
    with_optimizer: bool = True

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> LoadStatePayload:
        d = cls._fields_of(data)
        return cls(
            path=_check(d.get("path"), str, "path", optional=True),
            directory=_check(d.get("directory"), str, "directory", optional=True),
            with_optimizer=_check(d.get("with_optimizer", True), bool, "with_optimizer"),
        )


@dataclass(frozen=True)
class RejectedPayload(Payload):
    """A request the gateway turned down (bad body, a missing checkpoint...) after it had taken its seq_id: queued in
    its place so the adapter's chain has no hole, and answered with this error without touching the engine."""

    KIND_NAME: ClassVar[str] = "rejected"
    rejected_kind: str = ""  # the kind the caller asked for (its route)
    error_type: str = "InvalidRequestError"  # an errors.py class name
    message: str = ""

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RejectedPayload:
        d = cls._fields_of(data)
        return cls(
            rejected_kind=_check(d.get("rejected_kind", ""), str, "rejected_kind"),
            error_type=_check(d.get("error_type", "InvalidRequestError"), str, "error_type"),
            message=_check(d.get("message", ""), str, "message"),
        )


@dataclass(frozen=True)
class SamplePayload(Payload):
    """A sampling request: `num_samples` continuations of `prompt` from the frozen sampler snapshot `snapshot` (an
    adapter id in the pool: the copy a save_weights_for_sampler took), or from the bare base model when None. The
    envelope's model_id is the sampling session's id, its seq_id the client's sampling counter: the idempotency key.
    Sampling requests sit outside every adapter's seq_id chain (their order does not matter)."""

    KIND_NAME: ClassVar[str] = "sample"
    prompt: tuple[int, ...] = ()
    snapshot: str | None = None
    # The sampler checkpoint's folder: a pool that no longer holds the snapshot in memory (a restart) loads it from here.
    snapshot_dir: str | None = None
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True  # Tinker: `stop=[]` samples through EOS up to max_tokens
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SamplePayload:
        d = cls._fields_of(data)
        prompt = _check(d.get("prompt", []), (list, tuple), "prompt")
        stop_ids = _check(d.get("stop_token_ids", []), (list, tuple), "stop_token_ids")
        stop_strings = _check(d.get("stop_strings", []), (list, tuple), "stop_strings")
        return cls(
            prompt=tuple(_check(t, int, "prompt[]") for t in prompt),
            snapshot=_check(d.get("snapshot"), str, "snapshot", optional=True),
            snapshot_dir=_check(d.get("snapshot_dir"), str, "snapshot_dir", optional=True),
            num_samples=_check(d.get("num_samples", 1), int, "num_samples"),
            max_tokens=_check(d.get("max_tokens", 16), int, "max_tokens"),
            temperature=float(_check(d.get("temperature", 1.0), (int, float), "temperature")),
            top_k=_check(d.get("top_k", -1), int, "top_k"),
            top_p=float(_check(d.get("top_p", 1.0), (int, float), "top_p")),
            seed=_check(d.get("seed"), int, "seed", optional=True),
            stop_token_ids=tuple(_check(t, int, "stop_token_ids[]") for t in stop_ids),
            stop_strings=tuple(_check(s, str, "stop_strings[]") for s in stop_strings),
            stop_at_eos=_check(d.get("stop_at_eos", True), bool, "stop_at_eos"),
            prompt_logprobs=_check(d.get("prompt_logprobs", False), bool, "prompt_logprobs"),
            topk_prompt_logprobs=_check(d.get("topk_prompt_logprobs", 0), int, "topk_prompt_logprobs"),
            topk_sample_logprobs=_check(d.get("topk_sample_logprobs", 0), int, "topk_sample_logprobs"),
        )

    @property
    def num_tokens(self) -> int:
        """What the sample costs the pool, for queue quotas and plan budgets: its prompt and the most it can add."""
        return len(self.prompt) + self.num_samples * self.max_tokens
