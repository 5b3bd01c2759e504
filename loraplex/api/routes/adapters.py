"""Adapters: create, list, read, delete, and the training calls that return futures."""

from __future__ import annotations

import secrets
import uuid

from fastapi import APIRouter

from loraplex.api.deps import DbDep, ServicesDep, TenantDep, write_session
from loraplex.api.routes.checkpoints import checkpoint_dir, resolve_path
from loraplex.api.schemas import AdapterOut, CreateAdapterRequest, ForwardBackwardRequest, FutureRef, OptimStepRequest
from loraplex.api.submit import enqueue
from loraplex.dispatch.plan import RequestKind
from loraplex.errors import InvalidRequestError
from loraplex.storage.models import Adapter
from loraplex.storage.repositories import AdapterRepository

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

def _out(adapter: Adapter) -> AdapterOut:
    return AdapterOut(
        model_id=adapter.model_id,
        base_model=adapter.base_model,
        rank=adapter.rank,
        alpha=adapter.alpha,
        seed=adapter.seed,
        status=str(adapter.status),
        applied_seq_id=adapter.applied_seq_id,
        target_modules=list(adapter.target_modules),
        created_at=adapter.created_at,
        last_used_at=adapter.last_used_at,
    )


@router.post("", status_code=202)
def create_adapter(body: CreateAdapterRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    """A new adapter from its seed, or (`from_checkpoint`) from one of the tenant's checkpoints."""
    settings = services.settings
    base_model = body.base_model or settings.base_model
    if base_model != settings.base_model:
        raise InvalidRequestError(f"base_model {base_model!r} is not served here; this pool serves {settings.base_model!r}")
    rank, alpha, seed = body.rank, body.alpha, body.seed
    from_checkpoint: dict[str, object] | None = None
    if body.from_checkpoint is not None:
        given = sorted({"rank", "alpha", "seed"} & body.model_fields_set)
        if given:
            raise InvalidRequestError(f"{', '.join(given)}: taken from the checkpoint; leave out with from_checkpoint")
        with services.sessions() as db:  # 404 for a missing checkpoint or another tenant's
            checkpoint = resolve_path(db, tenant.id, body.from_checkpoint, body.with_optimizer)
            source = AdapterRepository(db, tenant.id).get(checkpoint.model_id, include_deleted=True)
        if list(source.target_modules) != list(settings.target_modules) or source.base_model != base_model:
            raise InvalidRequestError(f"{body.from_checkpoint} was trained for another base model or target modules")
        rank, alpha, seed = source.rank, source.alpha, source.seed
        from_checkpoint = {
            "path": body.from_checkpoint,
            "directory": str(checkpoint_dir(services, checkpoint)),
            "with_optimizer": body.with_optimizer,
        }
    if rank > settings.max_rank:
        raise InvalidRequestError(f"rank {rank} exceeds this pool's maximum rank {settings.max_rank}")
    alpha = alpha if alpha is not None else 2.0 * rank
    seed = seed if seed is not None else secrets.randbelow(2**31)
    model_id = uuid.uuid4().hex
    with write_session(services) as db:  # committed before the worker can report on it
        adapters = AdapterRepository(db, tenant.id)
        adapters.create(
            model_id=model_id,
            base_model=base_model,
            rank=rank,
            alpha=alpha,
            target_modules=list(settings.target_modules),
            seed=seed,
            user_metadata=body.user_metadata,
        )
        # seq_id 0 stands for the creation: the adapter's first step is seq_id 1, whatever order steps arrive in.
        adapters.record_applied(model_id, 0)
    payload = {
        "base_model": base_model,
        "rank": rank,
        "alpha": alpha,
        "seed": seed,
        "target_modules": list(settings.target_modules),
    }
    if from_checkpoint is not None:
        payload["from_checkpoint"] = from_checkpoint
    request_id = enqueue(
        services, tenant_id=tenant.id, model_id=model_id, kind=RequestKind.CREATE_ADAPTER, payload=payload
    )
    return FutureRef(request_id=request_id, model_id=model_id)


@router.get("")
def list_adapters(tenant: TenantDep, db: DbDep) -> list[AdapterOut]:
    return [_out(a) for a in AdapterRepository(db, tenant.id).list()]


@router.get("/{model_id}")
def get_adapter(model_id: str, tenant: TenantDep, db: DbDep) -> AdapterOut:
    return _out(AdapterRepository(db, tenant.id).get(model_id))


@router.delete("/{model_id}", status_code=202)
def delete_adapter(model_id: str, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    with write_session(services) as db:
        AdapterRepository(db, tenant.id).mark_deleted(model_id)
    request_id = enqueue(
        services,
        tenant_id=tenant.id,
        model_id=model_id,
        kind=RequestKind.DELETE_ADAPTER,
        payload={},
    )
    return FutureRef(request_id=request_id, model_id=model_id)


def _check_datums(body: ForwardBackwardRequest, services: ServicesDep) -> None:
    settings = services.settings
    if len(body.data) > settings.max_datums_per_request:
        raise InvalidRequestError(f"data has {len(body.data)} datums; at most {settings.max_datums_per_request}")
    for i, datum in enumerate(body.data):
        if len(datum.model_input) > settings.max_tokens_per_datum:
            raise InvalidRequestError(f"data[{i}] has {len(datum.model_input)} tokens; at most {settings.max_tokens_per_datum}")
        if body.loss_fn == "cross_entropy" and "target_tokens" not in datum.loss_fn_inputs:
            raise InvalidRequestError(f"data[{i}].loss_fn_inputs.target_tokens is required for cross_entropy")


def _check_live(services: ServicesDep, tenant: TenantDep, model_id: str) -> None:
    """404 for an unknown, deleted, or another tenant's adapter (a session of its own: the hot training calls take no
    DbDep, one worker-thread hop fewer)."""
    with services.sessions() as db:
        AdapterRepository(db, tenant.id).check_live(model_id)


def _training_call(
    model_id: str, body: ForwardBackwardRequest, kind: RequestKind, tenant: TenantDep, services: ServicesDep
) -> FutureRef:
    _check_live(services, tenant, model_id)
    _check_datums(body, services)
    payload = {
        "data": [d.model_dump() for d in body.data],
        "loss_fn": body.loss_fn,
        "loss_fn_config": body.loss_fn_config,
    }
    request_id = enqueue(services, tenant_id=tenant.id, model_id=model_id, seq_id=body.seq_id, kind=kind, payload=payload)
    return FutureRef(request_id=request_id, model_id=model_id)


@router.post("/{model_id}/forward_backward", status_code=202)
def forward_backward(model_id: str, body: ForwardBackwardRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return _training_call(model_id, body, RequestKind.FORWARD_BACKWARD, tenant, services)


@router.post("/{model_id}/forward", status_code=202)
def forward(model_id: str, body: ForwardBackwardRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    return _training_call(model_id, body, RequestKind.FORWARD, tenant, services)


@router.post("/{model_id}/optim_step", status_code=202)
def optim_step(model_id: str, body: OptimStepRequest, tenant: TenantDep, services: ServicesDep) -> FutureRef:
    _check_live(services, tenant, model_id)
    request_id = enqueue(
        services,
        tenant_id=tenant.id,
        model_id=model_id,
        seq_id=body.seq_id,
        kind=RequestKind.OPTIM_STEP,
        payload={"adam_params": body.adam_params.model_dump()},
    )
    return FutureRef(request_id=request_id, model_id=model_id)
