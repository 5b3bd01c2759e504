"""Turning an accepted request into a queued envelope and the future's reference. The owner of each request id is kept
beside it in Redis so that only the submitting tenant can read the future."""

from __future__ import annotations

from loraplex.protocol import Payload, RequestKind
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope
from loraplex.queue.producer import OWNER_TTL_S
from loraplex.service.context import Services, TenantQuotas, TenantRef
from loraplex.service.schemas import FutureRef
from loraplex.service.tenant_auth import check_queues


def enqueue(
    services: Services,
    *,
    tenant_id: str,
    model_id: str,
    kind: RequestKind,
    payload: Payload,
    seq_id: int | None = None,
    pool: str | None,
    quotas: TenantQuotas | None = None,
) -> str:
    """Queue one request on `pool` (the adapter's, or the sampler's: route_of; None: the gateway's own pool) and
    return its request id (the first one's, if (model_id, seq_id) was already queued). Create and delete take no
    seq_id: they sit outside the adapter's step order. `quotas`: the tenant's own queue quotas, where an operator set
    them (service/tenant_controls.py)."""
    envelope = Envelope.new(tenant_id=tenant_id, model_id=model_id, kind=kind, seq_id=seq_id, payload=payload)
    limits = None if quotas is None else (quotas.max_queued_requests, quotas.max_queued_tokens)
    # the script writes a new request's owner; a retry keeps the first request's (written with it)
    request_id, queued = services.producer.submit_checked(envelope, pool, limits=limits)
    if not queued:
        services.redis.set(keys.request_owner(request_id), tenant_id, ex=OWNER_TTL_S, nx=True)
    return request_id


def submit(
    services: Services,
    tenant: TenantRef,
    model_id: str,
    kind: RequestKind,
    payload: Payload,
    seq_id: int | None = None,
    *,
    pool: str | None,
) -> FutureRef:
    """`enqueue` of the kind's typed payload (loraplex/protocol) on `pool`, answered as the reference the client polls.
    The payload travels as it is: the envelope refuses one of another kind, and the queue's codec encodes it once.
    A suspended tenant, or a draining one's new work, is a 403 here (service/tenant_rules.py)."""
    check_queues(tenant, kind)
    request_id = enqueue(
        services, tenant_id=tenant.id, model_id=model_id, kind=kind, payload=payload, seq_id=seq_id, pool=pool,
        quotas=tenant.quotas,
    )
    return FutureRef(request_id=request_id, model_id=model_id)


def owner_of(services: Services, request_id: str) -> str | None:
    value = services.redis.get(keys.request_owner(request_id))
    return value.decode() if isinstance(value, bytes) else value


def already_submitted(services: Services, kind: RequestKind, model_id: str, seq_id: int) -> bool:
    """Whether (model_id, seq_id) was queued before: a retry must get the first request back, not a fresh check."""
    return bool(services.redis.exists(keys.request_idempotency_key(kind, model_id, seq_id)))


def existing_request_id(services: Services, kind: RequestKind, model_id: str, seq_id: int | None = None) -> str | None:
    """The request id queued under (model_id, seq_id) (or (model_id, kind) for create/delete), None if none is."""
    value = services.redis.get(keys.request_idempotency_key(kind, model_id, seq_id if seq_id is not None else -1))
    if value is None:
        return None
    return (value.decode() if isinstance(value, bytes) else str(value)).split(" ", 1)[0]
