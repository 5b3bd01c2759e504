"""A rejected step leaves no hole in its adapter's seq_id chain.

Clients (ours and the Tinker SDK) take a step's seq_id before they send it. When the gateway turns the step down after
that (a body that fails validation, a missing checkpoint, a taken checkpoint name...), the caller's NEXT step would
wait for the rejected seq_id until the gap timeout and then fail. So the rejection is queued in its place: a
`rejected` request (loraplex/protocol) under the same (model_id, seq_id), which the pool answers with the same error
without engine work, and the chain moves on.

Filled: the errors a caller cannot fix by sending the same request again (400, 404, 409, 413, 422), and 403 (the
tenant suspended or draining: the step is refused for good, and its clients go on after a resume). Not filled: 401
(no tenant to speak for), 429 and 503 (the caller retries the same seq_id), and a foreign or unknown adapter (its chain
is not this tenant's to touch). A seq_id that is already claimed (a retry, or a reused seq_id: the 409 itself) is left as
it is: there is no hole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.errors import ConflictError, LoraplexError, NotFoundError, error_name, http_status_for
from loraplex.protocol import CONTROL_KINDS, RejectedPayload, RequestKind
from loraplex.service.context import Services, TenantRef, db_engine
from loraplex.service.submit import submit
from loraplex.storage.repositories.adapters import live_pool_of

FILLED_STATUSES = frozenset({400, 403, 404, 409, 413, 422})


def fill_rejected(
    services: Services,
    tenant: TenantRef,
    model_id: str,
    seq_id: int,
    kind: RequestKind,
    error_type: type[LoraplexError],
    message: str,
) -> bool:
    """Queue the rejection of `kind` at (model_id, seq_id); False when there is nothing to fill."""
    if kind in CONTROL_KINDS:
        return False
    try:
        pool = live_pool_of(db_engine(services), tenant.id, model_id)
    except NotFoundError:
        return False
    payload = RejectedPayload(rejected_kind=str(kind), error_type=error_name(error_type), message=message)
    try:
        submit(services, tenant, model_id, RequestKind.REJECTED, payload, seq_id=seq_id, pool=pool)
    except ConflictError:
        return False  # the seq_id is claimed already
    return True


@contextmanager
def filling_rejections(
    services: Services, tenant: TenantRef, model_id: str, seq_id: int, kind: RequestKind
) -> Iterator[None]:
    """Around a chain step's checks and submit: a rejection is queued in the seq_id's place, then raised as it was."""
    try:
        yield
    except LoraplexError as exc:
        if http_status_for(exc) in FILLED_STATUSES:
            fill_rejected(services, tenant, model_id, seq_id, kind, type(exc), exc.message)
        raise
