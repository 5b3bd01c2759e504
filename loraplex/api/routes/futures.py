"""Futures: a long-poll that answers as soon as the result is stored, or its current state after the wait, with a
`queue_state`: "active", or "paused_capacity" and a reason while this gateway's pool is down (no recent heartbeat,
or loading its model), so a waiting client learns why nothing happens. A wait takes one of the tenant's long-poll
slots (service/long_polls.py: 429 past its limit); a poll with timeout=0 takes none."""

from __future__ import annotations

from fastapi import APIRouter, Query

from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.errors import NotFoundError
from loraplex.service import owner_of
from loraplex.service.schemas import ErrorOut, FutureOut

router = APIRouter(prefix="/v1/futures", tags=["futures"])


@router.get("/{request_id}")
def get_future(
    request_id: str,
    tenant: TenantDep,
    services: ServicesDep,
    timeout: float = Query(10.0, ge=0, le=60, description="Seconds to wait for the result before answering pending"),
) -> FutureOut:
    if owner_of(services, request_id) != tenant.id:
        raise NotFoundError(f"no request {request_id!r}")
    wait_s = min(timeout, services.settings.long_poll_seconds)
    outcome = None
    if wait_s > 0:
        with services.long_polls.hold(tenant.id, tenant.name):
            outcome = services.results.wait(request_id, wait_s)
    if outcome is None:  # not there when the wait ended: read result and state together (it may have just landed)
        outcome, state = services.results.result_and_state(request_id)
        if outcome is None:
            pool = services.pool_view.get(services.settings, services.sessions)
            return FutureOut(
                request_id=request_id,
                state=str(state or "queued"),
                queue_state=pool.queue_state,
                queue_state_reason=pool.reason or None,
            )
    if outcome.ok:
        result = None if outcome.result is None else outcome.result.to_wire()
        return FutureOut(request_id=request_id, state="complete", result=result)
    error = ErrorOut(type=outcome.error_name or "", message=outcome.error or "", category=outcome.exception().category)
    return FutureOut(request_id=request_id, state="failed", error=error)
