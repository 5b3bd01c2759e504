"""The training calls: forward_backward, forward and optim_step, each a step in the adapter's seq_id order that
returns a future. They take the request's payload (protocol/payloads.py), whichever front end built it (the native
JSON routes from their body model, the Tinker routes straight from the protobuf message, the pipelines), and check it
here, once, before it is queued. They are the hot path: the adapter check is one prebuilt statement on a plain
connection of its own (no ORM session), read afresh on every call: no cache can send a step to an adapter's old pool."""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.errors import InvalidRequestError, RequestTooLargeError
from loraplex.protocol import KINDS, ForwardBackwardPayload, OptimStepPayload, RequestKind
from loraplex.protocol.adam import ADAM_FIELD, adam_problems
from loraplex.protocol.losses import LOSS_NAMES
from loraplex.service.context import Services, TenantRef, db_engine
from loraplex.service.rejections import filling_rejections
from loraplex.service.schemas import FutureRef
from loraplex.service.submit import submit
from loraplex.settings import Settings
from loraplex.storage.repositories.adapters import live_pool_of


def check_live(services: Services, tenant: TenantRef, model_id: str) -> str | None:
    """404 for an unknown, deleted, or another tenant's adapter; else the pool it is placed on, where its requests go
    (None: the gateway's own). One row read on a connection of its own: the hot training calls take no request-wide
    session (one worker-thread hop fewer), and this check no ORM session either."""
    return live_pool_of(db_engine(services), tenant.id, model_id)


def check_sizes(settings: Settings, tokens: Sequence[int], loss_inputs: Sequence[int]) -> None:
    """The pool's size limits on a forward_backward, from its counts (per datum: its tokens, its loss_fn_inputs):
    datums per request, tokens and loss inputs per datum, tokens per request; a 413 naming the setting. The Tinker
    codec runs it on the counts a protobuf body declares, before it expands anything; check_forward_backward on the
    built payload."""
    if len(tokens) > settings.max_datums_per_request:
        raise RequestTooLargeError(
            f"data has {len(tokens)} datums; at most {settings.max_datums_per_request} per request "
            "(LORAPLEX_MAX_DATUMS_PER_REQUEST)"
        )
    for i, (n, inputs) in enumerate(zip(tokens, loss_inputs, strict=True)):
        if n > settings.max_tokens_per_datum:
            raise RequestTooLargeError(
                f"data[{i}] has {n} tokens; at most {settings.max_tokens_per_datum} per datum "
                "(LORAPLEX_MAX_TOKENS_PER_DATUM)"
            )
        if inputs > settings.max_loss_inputs_per_datum:
            raise RequestTooLargeError(
                f"data[{i}] has {inputs} loss_fn_inputs; at most {settings.max_loss_inputs_per_datum} "
                "(LORAPLEX_MAX_LOSS_INPUTS_PER_DATUM)"
            )
    total = sum(tokens)
    if total > settings.max_tokens_per_request:
        raise RequestTooLargeError(
            f"data has {total} tokens; at most {settings.max_tokens_per_request} per request "
            "(LORAPLEX_MAX_TOKENS_PER_REQUEST): split it into several forward_backward calls"
        )


def check_forward_backward(settings: Settings, kind: RequestKind, payload: ForwardBackwardPayload) -> None:
    """Every rule on a forward_backward or forward, on its payload: the size limits (tokens counted by the kind's
    row, as the quotas and plans count them), a known loss, and per datum: input tokens (at least one, no negative
    id), one loss input value per token, cross_entropy's targets. A NaN or infinity anywhere is refused when the
    payload is encoded for the queue (queue/envelope.py, NonFiniteNumberError naming where it is)."""
    data = payload.data
    if not data:
        raise InvalidRequestError("data is empty: at least one datum is needed")
    count = KINDS[kind].tokens
    tokens = [count(payload, (i, i + 1)) for i in range(len(data))]
    check_sizes(settings, tokens, [len(d.loss_fn_inputs) for d in data])
    if payload.loss_fn not in LOSS_NAMES:
        raise InvalidRequestError(f"loss_fn {payload.loss_fn!r} is not one of {', '.join(LOSS_NAMES)}")
    for i, (datum, n) in enumerate(zip(data, tokens, strict=True)):
        if n == 0:
            raise InvalidRequestError(f"data[{i}].model_input is empty: at least one token is needed")
        if min(datum.model_input) < 0:
            raise InvalidRequestError(f"data[{i}].model_input holds a negative token id")
        for name, values in datum.loss_fn_inputs.items():
            if len(values) != n:
                raise InvalidRequestError(
                    f"data[{i}].loss_fn_inputs.{name} has {len(values)} values, model_input has {n}"
                )
        if payload.loss_fn == "cross_entropy" and "target_tokens" not in datum.loss_fn_inputs:
            raise InvalidRequestError(f"data[{i}].loss_fn_inputs.target_tokens is required for cross_entropy")


def check_optim_step(payload: OptimStepPayload) -> None:
    """AdamW's hyperparameters by protocol/adam.py: known names, each within its bounds and finite."""
    params = payload.adam_params or {}
    unknown = sorted(set(params) - set(ADAM_FIELD))
    if unknown:
        raise InvalidRequestError(f"adam_params: unknown {', '.join(unknown)} (known: {', '.join(ADAM_FIELD)})")
    problems = adam_problems(params)
    if problems:
        raise InvalidRequestError("; ".join(f"adam_params.{p}" for p in problems))


def forward_backward(
    services: Services, tenant: TenantRef, model_id: str, seq_id: int, payload: ForwardBackwardPayload
) -> FutureRef:
    """Accumulate gradients; the result holds per-datum logprobs and the loss metrics."""
    pool = check_live(services, tenant, model_id)
    return submit_pass(services, tenant, model_id, seq_id, payload, RequestKind.FORWARD_BACKWARD, pool)


def forward(
    services: Services, tenant: TenantRef, model_id: str, seq_id: int, payload: ForwardBackwardPayload
) -> FutureRef:
    """Outputs and loss only; no gradient."""
    pool = check_live(services, tenant, model_id)
    return submit_pass(services, tenant, model_id, seq_id, payload, RequestKind.FORWARD, pool)


def submit_pass(
    services: Services,
    tenant: TenantRef,
    model_id: str,
    seq_id: int,
    payload: ForwardBackwardPayload,
    kind: RequestKind,
    pool: str | None,
) -> FutureRef:
    """A forward_backward or forward (`kind`) whose adapter `check_live` found placed on `pool` in this request (the
    Tinker route checks it before it expands the body, and passes what it read instead of reading it twice): checked
    and queued there."""
    with filling_rejections(services, tenant, model_id, seq_id, kind):
        check_forward_backward(services.settings, kind, payload)
        return submit(services, tenant, model_id, kind, payload, seq_id=seq_id, pool=pool)


def optim_step(
    services: Services, tenant: TenantRef, model_id: str, seq_id: int, payload: OptimStepPayload
) -> FutureRef:
    """Apply the accumulated gradients with AdamW and clear them."""
    pool = check_live(services, tenant, model_id)
    with filling_rejections(services, tenant, model_id, seq_id, RequestKind.OPTIM_STEP):
        check_optim_step(payload)
        return submit(services, tenant, model_id, RequestKind.OPTIM_STEP, payload, seq_id=seq_id, pool=pool)
