"""Request kinds, declared once. Each kind's row holds every per-kind fact a layer branches on: which engine step
runs it, its payload type, whether it sits outside the adapter's seq_id chain (create/delete) or every chain
(samples), which checkpoint it writes, whether its success changes the adapter's training state (replayed after a
restart, due for a snapshot), whether it skips the tenant's queue quotas, whether its adapters must be resident in
slots, whether it is billed as usage, and its token count (one function: the queue's quota, the plan's budgets and
the usage records all read it). The gateway's codec, the producer, the policy, the dispatcher loop, the executor, the
snapshotter and the recorder read this table: a new kind is one row here, its payload, its handler, its service call
and its route."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

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
from loraplex.protocol.results import (
    CreateResult,
    DeleteResult,
    ForwardBackwardResult,
    LoadResult,
    OptimStepResult,
    RejectedResult,
    Result,
    SampleResult,
    SaveResult,
)
from loraplex.protocol.wire import from_json


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
    SAMPLE = "sample"  # continuations of a prompt from a sampler copy (or the base model); in no seq_id chain


class StepKind(StrEnum):
    CREATE = "create"  # initialise adapters from their seeds
    DELETE = "delete"  # zero slots, drop state
    FORWARD_BACKWARD = "forward_backward"  # one mixed batch; rows of forward-only requests get no gradient
    OPTIM_STEP = "optim_step"  # one batched AdamW update over the requests' adapters
    CHECKPOINT = "checkpoint"  # save_state / save_sampler / load_state requests, one by one, in seq_id order
    REJECT = "reject"  # rejected requests: each answered with its payload's error, no engine work
    SAMPLE = "sample"  # one batched generation over the plan's sampling requests (mixed sampler copies and base rows)


def no_tokens(payload: Any, part: tuple[int, int] | None = None) -> int:
    """The token count of a kind that carries none."""
    return 0


@dataclass(frozen=True)
class KindSpec:
    step: StepKind
    payload: type[Payload]
    result: type[Result]  # what a successful request answers (protocol/results.py)
    control: bool = False  # outside the seq_id chain: seq_id CONTROL_SEQ_ID, idempotent per (model_id, kind)
    # outside every chain, in any order, but idempotent per (model_id, seq_id) like a step (model_id: a sampling
    # session, not an adapter)
    unordered: bool = False
    trains: bool = False  # forward_backward rows that get gradients (FORWARD shares the step without them)
    saves: CheckpointKind | None = None  # the checkpoint a successful request writes
    # Its success changes the adapter's training state: replayed from the request log after a restart (the others
    # only advance the seq_id there) and due for a durable snapshot. Saves rewrite files, forwards compute outputs.
    changes_state: bool = False
    # Skips the tenant's queue quotas: a rejection must fill its seq_id, and a delete frees what a tenant holds.
    quota_exempt: bool = False
    needs_residency: bool = False  # its adapters are swapped into slots before its step runs
    # A chained training step the policy plans round by round with no other limit than tokens, slots, rounds and the
    # request budget (dispatch/policy.py's `takes_all` vouches only for these).
    plain_step: bool = False
    # A draining tenant may still queue it: a delete frees what the tenant holds, a rejection fills a seq_id.
    while_draining: bool = False
    # A suspended tenant may still queue it: the rejection of a step refused for the suspension fills its seq_id, so
    # the tenant's next step after a resume does not wait for it.
    while_suspended: bool = False
    counts_usage: bool = False  # a success is recorded as usage (tokens, its share of the plan's seconds)
    # Its tokens (of `part`, datums [start, stop), when it runs in parts): input tokens for forward_backward and
    # forward, a sample's prompt plus the most it can add, 0 otherwise. The queued-tokens quota, the policy's and
    # the loop's plan budgets, fair share and the usage records all count with it.
    tokens: Callable[[Any, tuple[int, int] | None], int] = no_tokens


_FB_TOKENS = ForwardBackwardPayload.tokens
KINDS: dict[RequestKind, KindSpec] = {
    RequestKind.CREATE_ADAPTER: KindSpec(
        StepKind.CREATE, CreateAdapterPayload, result=CreateResult, control=True, changes_state=True, quota_exempt=True
    ),
    RequestKind.DELETE_ADAPTER: KindSpec(
        StepKind.DELETE, DeleteAdapterPayload, result=DeleteResult, control=True, quota_exempt=True,
        while_draining=True,
    ),  # fmt: skip
    RequestKind.FORWARD_BACKWARD: KindSpec(
        StepKind.FORWARD_BACKWARD, ForwardBackwardPayload, result=ForwardBackwardResult, trains=True,
        changes_state=True, needs_residency=True, counts_usage=True, tokens=_FB_TOKENS, plain_step=True,
    ),  # fmt: skip
    RequestKind.FORWARD: KindSpec(
        StepKind.FORWARD_BACKWARD, ForwardBackwardPayload, result=ForwardBackwardResult, needs_residency=True,
        counts_usage=True, tokens=_FB_TOKENS, plain_step=True,
    ),  # fmt: skip
    RequestKind.OPTIM_STEP: KindSpec(
        StepKind.OPTIM_STEP, OptimStepPayload, result=OptimStepResult, changes_state=True, needs_residency=True,
        plain_step=True,
    ),  # fmt: skip
    RequestKind.SAVE_STATE: KindSpec(
        StepKind.CHECKPOINT, SaveCheckpointPayload, result=SaveResult, saves=CheckpointKind.STATE, needs_residency=True
    ),
    RequestKind.SAVE_SAMPLER: KindSpec(
        StepKind.CHECKPOINT, SaveCheckpointPayload, result=SaveResult, saves=CheckpointKind.SAMPLER,
        needs_residency=True,
    ),  # fmt: skip
    RequestKind.LOAD_STATE: KindSpec(
        StepKind.CHECKPOINT, LoadStatePayload, result=LoadResult, changes_state=True, needs_residency=True
    ),
    RequestKind.REJECTED: KindSpec(
        StepKind.REJECT, RejectedPayload, result=RejectedResult, quota_exempt=True, while_draining=True,
        while_suspended=True,
    ),  # fmt: skip
    RequestKind.SAMPLE: KindSpec(
        StepKind.SAMPLE, SamplePayload, result=SampleResult, unordered=True, tokens=SamplePayload.tokens
    ),
}
assert set(KINDS) == set(RequestKind), "every request kind needs its row"

# create/delete are not steps in the adapter's seq_id chain: they carry this seq_id.
CONTROL_SEQ_ID = -1
CONTROL_KINDS = frozenset(k for k, spec in KINDS.items() if spec.control)
UNORDERED_KINDS = frozenset(k for k, spec in KINDS.items() if spec.unordered)
# Kinds whose request does not take a place in an adapter's seq_id chain (nothing to record as applied).
UNCHAINED_KINDS = CONTROL_KINDS | UNORDERED_KINDS
SAVE_KINDS = frozenset(k for k, spec in KINDS.items() if spec.saves)
STATE_KINDS = frozenset(k for k, spec in KINDS.items() if spec.changes_state)
PLAIN_STEP_KINDS = frozenset(k for k, spec in KINDS.items() if spec.plain_step)
WHILE_DRAINING_KINDS = frozenset(k for k, spec in KINDS.items() if spec.while_draining)
WHILE_SUSPENDED_KINDS = frozenset(k for k, spec in KINDS.items() if spec.while_suspended)
# A step kind's adapters must be in slots when any of its request kinds needs them there.
RESIDENT_STEPS = frozenset(spec.step for spec in KINDS.values() if spec.needs_residency)


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
    return from_json(model, payload if payload is not None else {})


def tokens_of(kind: RequestKind, payload: Payload, part: tuple[int, int] | None = None) -> int:
    """The request's token count by its kind's row (see KindSpec.tokens)."""
    return KINDS[kind].tokens(payload, part)
