"""Samplers and sampling (native): a sampler over one of the tenant's sampler checkpoints or the base model, then
sampling requests under its id with the client's counter as seq_id (service/sampling.py)."""

from __future__ import annotations

from fastapi import APIRouter

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.json_body import JsonBodyRoute
from loraplex.service.schemas import CreateSamplerRequest, FutureRef, SampleRequest, SamplerOut

router = APIRouter(prefix="/v1/samplers", tags=["sampling"], route_class=JsonBodyRoute)


@router.post("", status_code=201)
def create_sampler(body: CreateSamplerRequest, tenant: TenantDep, services: ServicesDep) -> SamplerOut:
    return service.create_sampler(services, tenant, body)


@router.get("/{sampler_id}")
def get_sampler(sampler_id: str, tenant: TenantDep, services: ServicesDep) -> SamplerOut:
    return service.get_sampler(services, tenant, sampler_id)


@router.post("/{sampler_id}/sample", status_code=202)
def sample(sampler_id: str, body: SampleRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    """The future's result: {sequences: [{tokens, logprobs, stop_reason, topk_logprobs?}], prompt_logprobs?, ...}."""
    return service.sample(services, tenant, sampler_id, body)
