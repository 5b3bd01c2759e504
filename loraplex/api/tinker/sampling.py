"""Tinker sampling routes: create_sampling_session, samplers/{id}, asample (a future with `sample_sequence_ids`; its
result a protobuf SampleResponse). Over the same service calls as `/v1/samplers` (service/sampling.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ValidationError

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.errors import validation_summary
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.tinker.futures import sample_future_out
from loraplex.api.tinker.schemas import AsampleBody, CreateSamplingSessionBody
from loraplex.errors import InvalidRequestError, NotSupportedError
from loraplex.service.schemas import CreateSamplerRequest, SampleRequest

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=JsonBodyRoute)

DEFAULT_MAX_TOKENS = 16  # the SDK's SamplingParams leaves max_tokens unset by default


@router.post("/create_sampling_session")
def create_sampling_session(
    body: CreateSamplingSessionBody, tenant: TenantDep, services: ServicesDep
) -> dict[str, Any]:
    sampler = service.create_sampler(
        services,
        tenant,
        CreateSamplerRequest(model_path=body.model_path, base_model=body.base_model),
        session_id=body.session_id,
        sampling_session_seq_id=body.sampling_session_seq_id,
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    return service.get_sampler(services, tenant, sampler_id).model_dump()


@router.post("/asample")
def asample(body: AsampleBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    if body.sampling_session_id is None or body.seq_id is None:
        raise InvalidRequestError("asample needs a sampling_session_id and its seq_id (create_sampling_session first)")
    unsupported = [name for name, value in (("target_prompt_logprobs", body.target_prompt_logprobs),
                                            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                                            ("prompt_logprobs_last_n", body.prompt_logprobs_last_n),
                                            ("record_stability_info", body.record_stability_info)) if value]  # fmt: skip
    if unsupported:
        raise NotSupportedError(f"{', '.join(unsupported)}: not offered by this server's sampler")
    tokens: list[int] = []
    for i, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise NotSupportedError(f"prompt.chunks[{i}] is a {chunk.type} chunk: this pool takes text tokens only")
        tokens.extend(chunk.tokens)
    params = body.sampling_params
    try:
        request = SampleRequest(
            seq_id=body.seq_id,
            prompt=tokens,
            num_samples=body.num_samples,
            max_tokens=params.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop,
            prompt_logprobs=bool(body.prompt_logprobs),
            topk_prompt_logprobs=body.topk_prompt_logprobs,
            topk_sample_logprobs=body.topk_sample_logprobs,
        )
    except ValidationError as exc:
        raise InvalidRequestError(validation_summary(exc.errors())) from None
    ref = service.sample(services, tenant, body.sampling_session_id, request)
    return sample_future_out(ref, body.num_samples)
