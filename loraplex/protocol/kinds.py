"""Request kinds, declared once. Each kind's row says which engine step runs it, its payload type, whether it sits
outside the adapter's seq_id chain (create/delete), and which checkpoint it writes. The policy, the dispatcher loop,
the executor, the recorder and the envelope codec read this table: a new kind is one row here plus its handler."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from loraplex.protocol.checkpoint_paths import CheckpointKind
from loraplex.protocol.payloads import (
    CreateAdapterPayload,
    DeleteAdapterPayload,
    ForwardBackwardPayload,
    LoadStatePayload,
    OptimStepPayload,
    Payload,
    RejectedPayload,
    SamplePayload,
    SaveCheckpointPayload,
)


class RequestKind(StrEnum):
    CREATE_ADAPTER = "create_adapter"
    DELETE_ADAPTER = "delete_adapter"
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"  # weights + optimizer state -> checkpoint files
    SAVE_SAMPLER = "save_sampler"  # weights only (for sampling / export)
    LOAD_STATE = "load_state"  # checkpoint files -> this (new or existing) adapter
    REJECTED = "rejected"  # a request the gateway rejected after its seq_id was taken: answered with its error
    SAMPLE = "sample"  # continuations of a prompt from a sampler snapshot (or the base model); in no seq_id chain


class StepKind(StrEnum):
    CREATE = "create"  # initialise adapters from their seeds
    DELETE = "delete"  # zero slots, drop state
    FORWARD_BACKWARD = "forward_backward"  # one mixed batch; rows of forward-only requests get no gradient
    OPTIM_STEP = "optim_step"  # one batched AdamW update over the requests' adapters
    CHECKPOINT = "checkpoint"  # save_state / save_sampler / load_state requests, one by one, in seq_id order
    REJECT = "reject"  # rejected requests: each answered with its payload's error, no engine work
    SAMPLE = "sample"  # one batched generation over the plan's sampling requests (mixed snapshots and base rows)


@dataclass(frozen=True)
class KindSpec:
    step: StepKind
    payload: type[Payload]
    control: bool = False  # outside the seq_id chain: seq_id CONTROL_SEQ_ID, idempotent per (model_id, kind)
    # outside every chain, in any order, but idempotent per (model_id, seq_id) like a step (model_id: a sampling
    # session, not an adapter)
    unordered: bool = False
    trains: bool = False  # forward_backward rows that get gradients (FORWARD shares the step without them)
    saves: CheckpointKind | None = None  # the checkpoint a successful request writes


KINDS: dict[RequestKind, KindSpec] = {
    RequestKind.CREATE_ADAPTER: KindSpec(StepKind.CREATE, CreateAdapterPayload, control=True),
    RequestKind.DELETE_ADAPTER: KindSpec(StepKind.DELETE, DeleteAdapterPayload, control=True),
    RequestKind.FORWARD_BACKWARD: KindSpec(StepKind.FORWARD_BACKWARD, ForwardBackwardPayload, trains=True),
    RequestKind.FORWARD: KindSpec(StepKind.FORWARD_BACKWARD, ForwardBackwardPayload),
    RequestKind.OPTIM_STEP: KindSpec(StepKind.OPTIM_STEP, OptimStepPayload),
    RequestKind.SAVE_STATE: KindSpec(StepKind.CHECKPOINT, SaveCheckpointPayload, saves=CheckpointKind.STATE),
    RequestKind.SAVE_SAMPLER: KindSpec(StepKind.CHECKPOINT, SaveCheckpointPayload, saves=CheckpointKind.SAMPLER),
    RequestKind.LOAD_STATE: KindSpec(StepKind.CHECKPOINT, LoadStatePayload),
    RequestKind.REJECTED: KindSpec(StepKind.REJECT, RejectedPayload),
    RequestKind.SAMPLE: KindSpec(StepKind.SAMPLE, SamplePayload, unordered=True),
}
assert set(KINDS) == set(RequestKind), "every request kind needs its row"

# create/delete are not steps in the adapter's seq_id chain: they carry this seq_id.
CONTROL_SEQ_ID = -1
CONTROL_KINDS = frozenset(k for k, spec in KINDS.items() if spec.control)
UNORDERED_KINDS = frozenset(k for k, spec in KINDS.items() if spec.unordered)
# Kinds whose request does not take a place in an adapter's seq_id chain (nothing to record as applied).
UNCHAINED_KINDS = CONTROL_KINDS | UNORDERED_KINDS
SAVE_KINDS = frozenset(k for k, spec in KINDS.items() if spec.saves)


def kinds_of_step(step: StepKind) -> frozenset[RequestKind]:
    return frozenset(k for k, spec in KINDS.items() if spec.step == step)


def parse_payload(kind: RequestKind | str, payload: object) -> Payload:
    """`payload` (its JSON form, a mapping; or already the kind's model) as the kind's payload model; ValueError
    naming the field when it does not fit."""
    model = KINDS[RequestKind(kind)].payload
    if isinstance(payload, model):
        return payload
    if isinstance(payload, Payload):
        raise ValueError(f"{kind} takes a {model.__name__}, not a {type(payload).__name__}")
    return model.from_wire(payload if payload is not None else {})  # type: ignore[arg-type]
