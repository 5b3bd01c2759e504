"""The training calls: forward_backward, forward and optim_step, each a step in the adapter's seq_id order that
returns a future. They are the hot path: the adapter check is one column read in a short session of its own."""

from __future__ import annotations

from loraplex.errors import InvalidRequestError, RequestTooLargeError
from loraplex.protocol import DatumPayload, ForwardBackwardPayload, OptimStepPayload, RequestKind
from loraplex.service.context import Services, TenantRef
from loraplex.service.rejections import filling_rejections
from loraplex.service.schemas import ForwardBackwardRequest, FutureRef, OptimStepRequest
from loraplex.service.submit import submit
from loraplex.settings import Settings
from loraplex.storage.repositories import AdapterRepository


def check_live(services: Services, tenant: TenantRef, model_id: str) -> None:
    """404 for an unknown, deleted, or another tenant's adapter (a session of its own: the hot training calls take no
    request-wide session, one worker-thread hop fewer)."""
    with services.sessions() as db:
        AdapterRepository(db, tenant.id).check_live(model_id)


def check_datums(settings: Settings, request: ForwardBackwardRequest) -> None:
    """The pool's limits on one request: datums per request, tokens per datum and per request (413); cross_entropy
    needs its targets."""
    if len(request.data) > settings.max_datums_per_request:
        raise InvalidRequestError(f"data has {len(request.data)} datums; at most {settings.max_datums_per_request}")
    tokens = sum(len(d.model_input) for d in request.data)
    if tokens > settings.max_tokens_per_request:
        raise RequestTooLargeError(
            f"data has {tokens} tokens; at most {settings.max_tokens_per_request} per request "
            "(LORAPLEX_MAX_TOKENS_PER_REQUEST): split it into several forward_backward calls"
        )
    for i, datum in enumerate(request.data):
        if len(datum.model_input) > settings.max_tokens_per_datum:
            raise InvalidRequestError(
                f"data[{i}] has {len(datum.model_input)} tokens; at most {settings.max_tokens_per_datum}"
            )
        if request.loss_fn == "cross_entropy" and "target_tokens" not in datum.loss_fn_inputs:
            raise InvalidRequestError(f"data[{i}].loss_fn_inputs.target_tokens is required for cross_entropy")


def forward_backward(
    services: Services, tenant: TenantRef, model_id: str, request: ForwardBackwardRequest
) -> FutureRef:
    """Accumulate gradients; the result holds per-datum logprobs and the loss metrics."""
    return _pass(services, tenant, model_id, request, RequestKind.FORWARD_BACKWARD)


def forward(services: Services, tenant: TenantRef, model_id: str, request: ForwardBackwardRequest) -> FutureRef:
    """Outputs and loss only; no gradient."""
    return _pass(services, tenant, model_id, request, RequestKind.FORWARD)


def _pass(
    services: Services, tenant: TenantRef, model_id: str, request: ForwardBackwardRequest, kind: RequestKind
) -> FutureRef:
    check_live(services, tenant, model_id)
    with filling_rejections(services, tenant, model_id, request.seq_id, kind):
        check_datums(services.settings, request)
        payload = ForwardBackwardPayload(
            data=tuple(DatumPayload(d.model_input, d.loss_fn_inputs) for d in request.data),
            loss_fn=request.loss_fn,
            loss_fn_config=request.loss_fn_config,
        )
        return submit(services, tenant, model_id, kind, payload, seq_id=request.seq_id)


def optim_step(services: Services, tenant: TenantRef, model_id: str, request: OptimStepRequest) -> FutureRef:
    """Apply the accumulated gradients with AdamW and clear them."""
    check_live(services, tenant, model_id)
    payload = OptimStepPayload(adam_params=request.adam_params.model_dump())
    return submit(services, tenant, model_id, RequestKind.OPTIM_STEP, payload, seq_id=request.seq_id)
