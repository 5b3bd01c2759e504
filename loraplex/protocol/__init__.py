"""The contract every layer shares: request kinds (declared once, with their payload types), plans and outcomes.
Stdlib only: the worker ranks import it on machines without the service's packages."""

from loraplex.protocol.kinds import (
    CONTROL_KINDS,
    CONTROL_SEQ_ID,
    KINDS,
    SAVE_KINDS,
    KindSpec,
    RequestKind,
    StepKind,
    kinds_of_step,
    parse_payload,
)
from loraplex.protocol.payloads import (
    CreateAdapterPayload,
    DatumPayload,
    DeleteAdapterPayload,
    ForwardBackwardPayload,
    FromCheckpoint,
    LoadStatePayload,
    OptimStepPayload,
    Payload,
    RejectedPayload,
    SaveCheckpointPayload,
)
from loraplex.protocol.plan import BatchPlan, Executor, Outcome, PlannedRequest, Step

__all__ = [
    "CONTROL_KINDS",
    "CONTROL_SEQ_ID",
    "KINDS",
    "SAVE_KINDS",
    "BatchPlan",
    "CreateAdapterPayload",
    "DatumPayload",
    "DeleteAdapterPayload",
    "Executor",
    "ForwardBackwardPayload",
    "FromCheckpoint",
    "KindSpec",
    "LoadStatePayload",
    "OptimStepPayload",
    "Outcome",
    "Payload",
    "PlannedRequest",
    "RejectedPayload",
    "RequestKind",
    "SaveCheckpointPayload",
    "Step",
    "StepKind",
    "kinds_of_step",
    "parse_payload",
]
