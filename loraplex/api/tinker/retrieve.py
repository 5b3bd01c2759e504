"""`POST /api/v1/retrieve_future`: a long-poll (up to LORAPLEX_TINKER_LONG_POLL_SECONDS, under the SDK's 45 s
timeout), then one of: the result (protobuf ForwardBackwardOutput for forward/forward_backward, SampleResponse for
asample, JSON for the rest),
`{error, category}` for a failed request (the SDK raises RequestFailedError with it), or `{type: try_again,
queue_state}` while it is still queued or running (`paused_capacity` and a reason while the pool is down). Only the
submitting tenant may read a future: anyone else gets the 404 an unknown id gets (the owner and a stored result are
read in one round trip). A wait takes one of the tenant's long-poll slots (service/long_polls.py): past its limit a
429 with Retry-After, which the SDK backs off from; a future already finished answers without one."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.tinker.codec import PROTOBUF_MEDIA_TYPE
from loraplex.api.tinker.futures import PROTO_TAGS, json_result, parse_future_id, proto_result
from loraplex.api.tinker.schemas import RetrieveFutureBody
from loraplex.errors import NotFoundError

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=JsonBodyRoute)


@router.post("/retrieve_future")
def retrieve_future(body: RetrieveFutureBody, tenant: TenantDep, services: ServicesDep) -> Response:
    tag, request_id, extra = parse_future_id(body.request_id)
    owner, outcome = services.results.owner_and_outcome(request_id) if request_id else (None, None)
    if owner != tenant.id:
        raise NotFoundError(f"no request {body.request_id!r}")
    if outcome is None:
        with services.long_polls.hold(tenant.id, tenant.name):
            outcome = services.results.wait(request_id, services.settings.tinker_long_poll_seconds, known_unstored=True)
    if outcome is None:  # not there when the wait ended: read result and state together (it may have just landed)
        outcome, _ = services.results.result_and_state(request_id)
    if outcome is None:
        pool = services.pool_view.get(services.settings, services.sessions)
        waiting = {"type": "try_again", "request_id": body.request_id, "queue_state": pool.queue_state}
        if pool.reason:
            waiting["queue_state_reason"] = pool.reason
        return JSONResponse(waiting)
    if not outcome.ok:
        category = outcome.exception().category
        return JSONResponse({"error": f"{outcome.error_name}: {outcome.error}", "category": category})
    result = {} if outcome.result is None else outcome.result.to_wire()
    if tag in PROTO_TAGS:
        return Response(proto_result(tag, result), media_type=PROTOBUF_MEDIA_TYPE)
    return JSONResponse(json_result(tag, result.get("model_id"), result, extra))
