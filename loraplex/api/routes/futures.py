"""Futures: a long-poll that answers as soon as the result is stored, or its current state after the wait, with a
`queue_state`: "active", or "paused_capacity" and a reason while this gateway's pool is down (no recent heartbeat,
or loading its model), so a waiting client learns why nothing happens. A wait takes one of the tenant's long-poll
slots (service/long_polls.py: 429 past its limit); a poll with timeout=0 takes none.

`also`: other request ids of the caller's; the answer carries those of them already finished (`also` in the body),
read once the wait ends. A client awaiting a forward_backward and then its optim_step, which usually finish in the
same plan, gets both in one round trip (loraplex/client/futures.py asks for its other unsettled futures)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from pydantic import Field

from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.protocol import Outcome
from loraplex.service.schemas import ErrorOut, FutureOut

router = APIRouter(prefix="/v1/futures", tags=["futures"], route_class=JsonBodyRoute)

MAX_ALSO = 32  # other request ids one poll may ask about


class FutureWithOthersOut(FutureOut):
    also: list[FutureOut] = Field(default_factory=list, description="the finished ones among the `also` request ids")


@router.get("/{request_id}")
def get_future(
    request_id: str,
    tenant: TenantDep,
    services: ServicesDep,
    timeout: float = Query(10.0, ge=0, le=60, description="Seconds to wait for the result before answering pending"),
    also: str = Query("", max_length=40 * MAX_ALSO,
                      description=f"Up to {MAX_ALSO} other request ids, comma-separated: those finished come back too"),
) -> FutureWithOthersOut:  # fmt: skip
    others = [rid for rid in also.split(",") if rid and rid != request_id]
    if len(others) > MAX_ALSO:
        raise InvalidRequestError(f"also: {len(others)} request ids, at most {MAX_ALSO}")
    owner, outcome = services.results.owner_and_outcome(request_id)
    if owner != tenant.id:
        raise NotFoundError(f"no request {request_id!r}")
    wait_s = min(timeout, services.settings.long_poll_seconds)
    if outcome is None and wait_s > 0:
        with services.long_polls.hold(tenant.id, tenant.name):
            outcome, done = services.results.wait_with_others(request_id, wait_s, others, tenant.id,
                                                              known_unstored=True)  # fmt: skip
    else:
        done = services.results.finished_of(others, tenant.id)
    finished = [FutureOut(**_answer(o)) for o in done]
    if outcome is None:  # not there when the wait ended: read result and state together (it may have just landed)
        outcome, state = services.results.result_and_state(request_id)
        if outcome is None:
            pool = services.pool_view.get(services.settings, services.sessions)
            return FutureWithOthersOut(
                request_id=request_id,
                state=str(state or "queued"),
                queue_state=pool.queue_state,
                queue_state_reason=pool.reason or None,
                also=finished,
            )
    return FutureWithOthersOut(**_answer(outcome), also=finished)


def _answer(outcome: Outcome) -> dict[str, Any]:
    """A finished request's fields of FutureOut."""
    if outcome.ok:
        result = None if outcome.result is None else outcome.result.to_wire()
        return {"request_id": outcome.request_id, "state": "complete", "result": result}
    error = ErrorOut(type=outcome.error_name or "", message=outcome.error or "", category=outcome.exception().category)
    return {"request_id": outcome.request_id, "state": "failed", "error": error}
