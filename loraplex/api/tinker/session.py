"""Tinker handshake and session routes: client/config, create_session, session_heartbeat, sessions/{id}/finish,
telemetry, get_server_capabilities, healthz. (Sampling: api/tinker/sampling.py.) `client/dynamic_config` is left out on purpose: its 404 tells the SDK to use its defaults."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep, TenantInAnyStateDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.tinker.schemas import CreateSessionBody, FinishBody, SessionBody
from loraplex.errors import NotSupportedError
from loraplex.service.health import health_report

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=JsonBodyRoute)
log = logging.getLogger("loraplex.api.tinker")

SESSION_INFO = (
    "loraplex trains LoRA on the base model's attention and MLP projections ({modules}); train_unembed is accepted "
    "and not trained. Closing the session frees its models (their checkpoints stay): save_state first."
)


@router.post("/client/config")
def client_config(tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    settings = services.settings
    return {
        "pjwt_auth_enabled": False,
        "parallel_fwdbwd_chunks": True,
        "proto_compress_fwdbwd": settings.tinker_compress_fwdbwd,
        "fwdbwd_max_chunk_len": min(1024, settings.max_datums_per_request),
    }


@router.post("/create_session")
def create_session(body: CreateSessionBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    session_id = service.create_session(services, tenant, body.tags, body.user_metadata or {})
    info = SESSION_INFO.format(modules=", ".join(services.settings.target_modules))
    return {"type": "create_session", "session_id": session_id, "info_message": info}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionBody, tenant: TenantInAnyStateDep, services: ServicesDep) -> dict[str, Any]:
    """404 unknown or another tenant's session; 410 once finished or expired (the SDK stops beating). A suspended
    tenant's session stays alive: its work goes on after the resume."""
    service.heartbeat(services, tenant, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(
    session_id: str, tenant: TenantDep, services: ServicesDep, body: FinishBody | None = None
) -> dict[str, Any]:
    reason = (body or FinishBody()).reason.type
    freed = service.finish_session(services, tenant, session_id, reason)
    return {"session_id": session_id, "status": "finished", "freed_models": freed}


@router.post("/telemetry")
def telemetry(tenant: TenantInAnyStateDep) -> dict[str, str]:
    """The SDK's telemetry batches are accepted and not kept (the service has its own metrics), from a suspended
    tenant too (its SDK reports the 403s it met)."""
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
def get_server_capabilities(tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """Every base model a pool of the fleet serves (service/fleet.py), by name."""
    served = service.served_models(services)
    return {
        "supported_models": [
            {
                "model_name": model.name,
                "max_context_length": services.settings.max_tokens_per_datum,
                "trainable": True,
                "sampleable": service.sampleable(services, model),  # the native sampler decodes dense and MoE
            }
            for model in served
        ]
    }


@router.get("/healthz")
def healthz(services: ServicesDep) -> JSONResponse:
    healthy, body = health_report(services)
    return JSONResponse(status_code=200 if healthy else 503, content=body)


def _sampling_later(tenant: TenantDep) -> None:
    raise NotSupportedError(
        "join_sampling_session is not offered (client/config leaves sample_join_sampling_session off)"
    )


router.add_api_route("/join_sampling_session", _sampling_later, methods=["POST"], status_code=400)
