"""Tinker training routes: create_model, get_info, forward_backward (protobuf), optim_step, save_weights,
save_weights_for_sampler, load_weights. Each translates the SDK's body and calls the same service function as the
native route (service/), so admission control, limits, tenant isolation and rejections that fill their seq_id
are one set of rules. Submit routes answer an UntypedAPIFuture whose id `retrieve_future` understands
(api/tinker/futures.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from loraplex import service
from loraplex.api.deps import ServicesDep, TenantDep
from loraplex.api.errors import validation_summary
from loraplex.api.json_body import JsonBodyRoute
from loraplex.api.routes.chain import seq_step
from loraplex.api.tinker.codec import decode_forward_backward, decompress, optim_step_payload
from loraplex.api.tinker.futures import Tag, future_out
from loraplex.api.tinker.model_info import tokenizer_id
from loraplex.api.tinker.schemas import (
    CreateModelBody,
    LoadWeightsBody,
    LoraConfigBody,
    ModelBody,
    OptimizerConfigBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
)
from loraplex.errors import InvalidRequestError, NotSupportedError
from loraplex.protocol import RequestKind
from loraplex.protocol.checkpoint_paths import CheckpointKind, tinker_path
from loraplex.service.context import Services, TenantRef
from loraplex.service.rejections import filling_rejections
from loraplex.service.schemas import (
    CreateAdapterRequest,
    CreateSamplerRequest,
    FutureRef,
    LoadStateRequest,
    SaveCheckpointRequest,
)
from loraplex.service.training import check_live, submit_pass

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=JsonBodyRoute)

# Tinker's lora_config groups -> the projection names they cover (intersected with the pool's target modules).
ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})


def tinker_model_id(session_id: str, model_seq_id: int) -> str:
    """The SDK fixes this id itself on create-via-load (tinker-wire.md finding 7); create_model uses it too."""
    return f"{session_id}:train:{model_seq_id}"


def target_modules_for(pool_modules: tuple[str, ...], lora: LoraConfigBody) -> tuple[str, ...]:
    """The pool's target modules (`pool_modules`: those of the base model's pools) that `lora_config` asks for.
    train_unembed is not trained here (no LoRA on the LM head): it is accepted and ignored, as create_session's
    info_message and the README say."""
    wanted = (ATTENTION_MODULES if lora.train_attn else frozenset()) | (MLP_MODULES if lora.train_mlp else frozenset())
    modules = tuple(m for m in pool_modules if m in wanted)
    if not modules:
        raise InvalidRequestError(
            "lora_config trains nothing this pool can: it trains LoRA on "
            f"{', '.join(pool_modules)}; set train_attn and/or train_mlp"
        )
    for group, flag, names in (("attention", lora.train_attn, ATTENTION_MODULES), ("MLP", lora.train_mlp, MLP_MODULES)):
        if flag and not names & set(pool_modules):
            raise InvalidRequestError(f"this pool has no {group} LoRA modules ({', '.join(pool_modules)})")
    return modules


def check_optimizer(config: OptimizerConfigBody | None) -> None:
    if config is not None and config.type != "adamw":
        raise NotSupportedError(
            f"optimizer {config.type!r} is not supported here: loraplex trains with AdamW only (Dimuon's update rule "
            "is internal to Tinker, so a copy could not promise the same training); use AdamOptimizerConfig"
        )


@router.post("/create_model")
def create_model(body: CreateModelBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    served = service.served_model(services, body.base_model or None)  # 400 naming the served models
    lora = body.lora_config or LoraConfigBody(rank=served.max_rank, seed=None)
    fields: dict[str, Any] = {"rank": lora.rank, "user_metadata": body.user_metadata or {}}
    if lora.seed is not None:
        fields["seed"] = lora.seed
    modules = target_modules_for(served.target_modules, lora)
    ref = _create_in_session(services, tenant, body.session_id, body.model_seq_id, body, fields, modules)
    return future_out(Tag.CREATE, ref)


def _create_in_session(
    services: Services,
    tenant: TenantRef,
    session_id: str,
    model_seq_id: int,
    body: CreateModelBody | LoadWeightsBody,
    fields: dict[str, Any],
    target_modules: tuple[str, ...] | None = None,
) -> FutureRef:
    """A new adapter `<session_id>:train:<model_seq_id>` of a live session of this tenant (create_model, and
    load_weights that creates)."""
    check_optimizer(body.optimizer_config)
    service.check_active(services, tenant, session_id)
    if body.base_model:
        fields["base_model"] = body.base_model
    return service.create_adapter(
        services,
        tenant,
        CreateAdapterRequest(**fields),
        model_id=tinker_model_id(session_id, model_seq_id),
        session_id=session_id,
        target_modules=target_modules,
    )


@router.post("/get_info")
def get_info(body: ModelBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    adapter = service.get_adapter(services, tenant, body.model_id)
    return {
        "type": "get_info",
        "model_id": adapter.model_id,
        "model_data": {
            "arch": "qwen3",
            "model_name": adapter.base_model,
            "tokenizer_id": tokenizer_id(services.settings, adapter.base_model),
        },
        "is_lora": True,
        "lora_rank": adapter.rank,
        "model_name": adapter.base_model,
    }


@router.post("/forward_backward")
@seq_step(RequestKind.FORWARD_BACKWARD)
async def forward_backward(request: Request, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """A protobuf ForwardBackwardRequest (zstd-compressed too); `forward_only` makes it a forward."""
    raw = await request.body()
    encoding = request.headers.get("content-encoding")
    return await run_in_threadpool(_forward_backward, services, tenant, raw, encoding)


def _forward_backward(services: Services, tenant: TenantRef, raw: bytes, encoding: str | None) -> dict[str, Any]:
    decoded = decode_forward_backward(decompress(raw, encoding, services.settings.max_body_bytes))
    # The owner first (404 for a missing or foreign adapter), then the declared sizes: no tensor is expanded for a
    # request that would be refused anyway. The service checks the built payload (tokens, lengths, loss).
    pool = check_live(services, tenant, decoded.model_id)
    with filling_rejections(services, tenant, decoded.model_id, decoded.seq_id, decoded.kind):
        decoded.check_sizes(services.settings)
        payload = decoded.payload()
    ref = submit_pass(services, tenant, decoded.model_id, decoded.seq_id, payload, decoded.kind, pool)
    return future_out(Tag.FORWARD, ref)


@router.post("/optim_step")
@seq_step(RequestKind.OPTIM_STEP)
async def optim_step(body: OptimStepBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """Async, its work in one worker-thread hop (api/routes/adapters.py says why)."""
    return await run_in_threadpool(_optim_step, services, tenant, body)


def _optim_step(services: Services, tenant: TenantRef, body: OptimStepBody) -> dict[str, Any]:
    if body.optimizer_params is not None and body.adam_params is None:
        with filling_rejections(services, tenant, body.model_id, body.seq_id, RequestKind.OPTIM_STEP):
            check_optimizer(OptimizerConfigBody(type=str(body.optimizer_params.get("type", "unknown"))))
    payload = optim_step_payload(body.adam_params.model_dump() if body.adam_params is not None else None)
    return future_out(Tag.OPTIM, service.optim_step(services, tenant, body.model_id, body.seq_id, payload))


@router.post("/save_weights")
@seq_step(RequestKind.SAVE_STATE)
def save_weights(body: SaveWeightsBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """save_state: weights + optimizer state, at tinker://<model_id>/weights/<path>."""
    request = _save_request(services, tenant, body, RequestKind.SAVE_STATE)
    return future_out(Tag.SAVE, service.save_state(services, tenant, body.model_id, request))


@router.post("/save_weights_for_sampler")
@seq_step(RequestKind.SAVE_SAMPLER)
def save_weights_for_sampler(
    body: SaveWeightsForSamplerBody, tenant: TenantDep, services: ServicesDep
) -> dict[str, Any]:
    """The named form: a sampler checkpoint. The unnamed one (save_weights_and_get_sampling_client): a sampler
    checkpoint of its own name (`sampling-<sampling_session_seq_id>-<seq_id>`, kept LORAPLEX_UNNAMED_SAMPLER_TTL_SECONDS)
    and a sampler over it, whose id the future answers."""
    if body.path is not None:
        request = _save_request(services, tenant, body, RequestKind.SAVE_SAMPLER)
        return future_out(Tag.SAVE_SAMPLER, service.save_weights_for_sampler(services, tenant, body.model_id, request))
    with filling_rejections(services, tenant, body.model_id, body.seq_id, RequestKind.SAVE_SAMPLER):
        if body.sampling_session_seq_id is None:
            raise InvalidRequestError("save_weights_for_sampler needs a path, or a sampling_session_seq_id")
        adapter = service.get_adapter(services, tenant, body.model_id)
    name = f"sampling-{body.sampling_session_seq_id}-{body.seq_id}"
    unnamed = body.model_copy(update={"path": name, "ttl_seconds": services.settings.unnamed_sampler_ttl_seconds,
                                      "overwrite": True})  # fmt: skip
    ref = service.save_weights_for_sampler(
        services, tenant, body.model_id, _save_request(services, tenant, unnamed, RequestKind.SAVE_SAMPLER)
    )
    sampler = service.create_sampler(
        services,
        tenant,
        CreateSamplerRequest(model_path=tinker_path(body.model_id, CheckpointKind.SAMPLER, name), base_model=None),
        session_id=adapter.session_id,
        sampling_session_seq_id=body.sampling_session_seq_id if adapter.session_id else None,
        saved_by=ref.request_id,
    )
    return future_out(Tag.SAMPLING_SESSION, ref, extra=sampler.sampler_id)


def _save_request(
    services: Services, tenant: TenantRef, body: SaveWeightsBody, kind: RequestKind
) -> SaveCheckpointRequest:
    name = body.path if body.path is not None else f"seq-{body.seq_id:06d}"
    with filling_rejections(services, tenant, body.model_id, body.seq_id, kind):
        try:
            return SaveCheckpointRequest(
                seq_id=body.seq_id, name=name, ttl_seconds=body.ttl_seconds, overwrite=body.overwrite
            )
        except ValidationError as exc:
            raise InvalidRequestError(validation_summary(exc.errors())) from None


@router.post("/load_weights")
@seq_step(RequestKind.LOAD_STATE)
def load_weights(body: LoadWeightsBody, tenant: TenantDep, services: ServicesDep) -> dict[str, Any]:
    """Create-via-load (session_id + model_seq_id: a new adapter from a checkpoint) or the deprecated load_state
    (model_id + seq_id: into that adapter)."""
    if body.model_id is not None:
        if body.seq_id is None:
            raise InvalidRequestError("load_weights into an existing model needs its seq_id")
        request = LoadStateRequest(seq_id=body.seq_id, path=body.path, with_optimizer=body.optimizer)
        return future_out(Tag.LOAD, service.load_state(services, tenant, body.model_id, request))
    if body.session_id is None or body.model_seq_id is None:
        raise InvalidRequestError("load_weights needs model_id + seq_id, or session_id + model_seq_id")
    fields: dict[str, Any] = {"from_checkpoint": body.path, "with_optimizer": body.optimizer}
    if body.user_metadata:
        fields["user_metadata"] = body.user_metadata
    ref = _create_in_session(services, tenant, body.session_id, body.model_seq_id, body, fields)
    return future_out(Tag.CREATE_FROM, ref)
