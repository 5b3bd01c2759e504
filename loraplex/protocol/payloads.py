"""The typed payload of each request kind: what the gateway puts in an envelope and the pool reads. Frozen
dataclasses, stdlib only (the worker ranks import this on machines without pydantic). The fields' type hints are the
whole wire contract: protocol/wire.py builds any payload from its JSON form by them (ValueError naming the field's
path when the shape is wrong), so a payload declares no decoder of its own. Element checks beyond the types (token id
ranges, lengths, loss inputs, Adam ranges) stay with the engine and the gateway; lenient where the worker owns the
check (a create without a rank, a checkpoint step without its folder fail per request in the executor with their own
message)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from loraplex.protocol.wire import from_json

P = TypeVar("P", bound="Payload")


@dataclass(frozen=True)
class Payload:
    """The base of every payload (the fields are the subclasses')."""

    KIND_NAME: ClassVar[str] = "payload"

    @classmethod
    def from_wire(cls: type[P], data: object) -> P:
        """The payload from its JSON form (protocol/wire.py); ValueError naming the field when the shape is wrong."""
        return from_json(cls, data)

    def to_wire(self) -> dict[str, Any]:
        """The JSON form as Python values (the queue's codec serializes the dataclass itself; this is for callers
        that want a mapping). Shallow: token and weight lists are handed over as they are, not copied
        (dataclasses.asdict deep-copies them)."""
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


@dataclass(frozen=True)
class CreateAdapterPayload(Payload):
    KIND_NAME: ClassVar[str] = "create_adapter"
    base_model: str = ""
    rank: int | None = None  # None: the executor fails the request ("needs a rank")
    alpha: float | None = None  # None: 2 x rank
    seed: int = 0
    target_modules: tuple[str, ...] | None = None
    from_checkpoint: FromCheckpoint | None = None  # None: a plain creation


@dataclass(frozen=True)
class DeleteAdapterPayload(Payload):
    KIND_NAME: ClassVar[str] = "delete_adapter"


@dataclass(frozen=True)
class DatumPayload(Payload):
    """One sequence: input tokens, and the loss inputs per position (target_tokens, weights, logprobs, advantages...).
    The lists are kept as sent (the decoder checks model_input's items are ints); the engine checks their values
    and the loss inputs' elements (workers/engine/batching.py)."""

    KIND_NAME: ClassVar[str] = "datum"
    model_input: list[int]
    loss_fn_inputs: dict[str, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardBackwardPayload(Payload):
    """forward_backward, and forward (outputs and loss only)."""

    KIND_NAME: ClassVar[str] = "forward_backward"
    data: tuple[DatumPayload, ...] = ()
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, Any] | None = None  # checked by the loss (workers/engine/losses.py)

    def tokens(self, part: tuple[int, int] | None = None) -> int:
        """Input tokens of its datums (of datums [start, stop) when it runs in parts)."""
        data = self.data if part is None else self.data[part[0] : part[1]]
        return sum(len(d.model_input) for d in data)


@dataclass(frozen=True)
class OptimStepPayload(Payload):
    KIND_NAME: ClassVar[str] = "optim_step"
    # AdamW hyperparameters by name (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm); the optimizer
    # checks names and ranges per request (None: its defaults).
    adam_params: dict[str, Any] | None = None


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


@dataclass(frozen=True)
class LoadStatePayload(Payload):
    KIND_NAME: ClassVar[str] = "load_state"
    path: str | None = None
    directory: str | None = None
    with_optimizer: bool = True


@dataclass(frozen=True)
class RejectedPayload(Payload):
    """A request the gateway turned down (bad body, a missing checkpoint...) after it had taken its seq_id: queued in
    its place so the adapter's chain has no hole, and answered with this error without touching the engine."""

    KIND_NAME: ClassVar[str] = "rejected"
    rejected_kind: str = ""  # the kind the caller asked for (its route)
    error_type: str = "InvalidRequestError"  # an errors.py class name
    message: str = ""


@dataclass(frozen=True)
class SamplePayload(Payload):
    """A sampling request: `num_samples` continuations of `prompt` from the sampler copy `sampler_copy` (an adapter
    id in the pool: the frozen copy of the weights a save_weights_for_sampler took), or from the bare base model when
    None. The
    envelope's model_id is the sampling session's id, its seq_id the client's sampling counter: the idempotency key.
    Sampling requests sit outside every adapter's seq_id chain (their order does not matter)."""

    KIND_NAME: ClassVar[str] = "sample"
    prompt: tuple[int, ...] = ()
    sampler_copy: str | None = None
    # The sampler checkpoint's folder: a pool that no longer holds the copy in memory (a restart) loads it from here.
    sampler_copy_dir: str | None = None
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
    # The answer streams (the OpenAI routes' `stream: true`): the pool publishes the tokens sampled so far after each
    # slice (queue/sample_partials.py).
    stream_partials: bool = False

    def tokens(self, part: tuple[int, int] | None = None) -> int:
        """What the sample costs the pool: its prompt and the most it can add (a sample never runs in parts)."""
        return len(self.prompt) + max(self.num_samples, 0) * max(self.max_tokens, 0)
