"""Adapters: create (from a seed, or from one of the tenant's checkpoints), list, read, delete."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence

from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, InvalidRequestError, QuotaExceededError, ServiceUnavailableError
from loraplex.protocol import CreateAdapterPayload, DeleteAdapterPayload, FromCheckpoint, RequestKind
from loraplex.service.checkpoints import checkpoint_dir, resolve_checkpoint
from loraplex.service.context import Services, TenantRef, fleet, write_session
from loraplex.service.fleet import ServedModel
from loraplex.service.free_text import check_storable
from loraplex.service.placement import PoolLoad, choose_pool
from loraplex.service.schemas import AdapterOut, CreateAdapterRequest, FutureRef
from loraplex.service.submit import existing_request_id, submit
from loraplex.service.tenant_auth import check_queues
from loraplex.storage.models import Adapter, AdapterStatus
from loraplex.storage.repositories import AdapterRepository, PoolRepository

ALPHA_PER_RANK = 2.0  # LoRA alpha when none is given: 2 x rank
SEED_LIMIT = 2**31  # a seed when none is given: uniform in [0, SEED_LIMIT)
# With from_checkpoint these come from the checkpoint's adapter: setting one is an error, not an override.
FROM_CHECKPOINT_FIELDS = frozenset({"rank", "alpha", "seed", "target_modules"})


def adapter_out(adapter: Adapter) -> AdapterOut:
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
        session_id=adapter.session_id,
    )


def create_adapter(
    services: Services,
    tenant: TenantRef,
    request: CreateAdapterRequest,
    *,
    model_id: str | None = None,
    session_id: str | None = None,
    target_modules: tuple[str, ...] | None = None,
) -> FutureRef:
    """A new adapter from its seed, or (`from_checkpoint`) from one of the tenant's checkpoints. The fields the caller
    set are `request.model_fields_set` (build the request with only those: rank, alpha and seed clash with
    from_checkpoint). Nothing is written when a check fails.

    The Tinker routes name the adapter themselves (`model_id` = "<session_id>:train:<n>", in `session_id`) and may
    train a subset of the pool's `target_modules`; sending the same creation again (the SDK retries) answers the
    first one's future."""
    settings = services.settings
    check_storable(request.user_metadata, "user_metadata")
    if model_id is not None:
        retry = _resubmit_create(services, tenant, model_id)
        if retry is not None:
            return retry
    check_queues(tenant, RequestKind.CREATE_ADAPTER)  # before the row is written: a draining tenant creates nothing
    served = served_model(services, request.base_model or None)  # 400 naming the served models
    base_model = served.name
    rank, alpha, seed = request.rank, request.alpha, request.seed
    from_checkpoint: FromCheckpoint | None = None
    if request.from_checkpoint is not None:
        given = sorted(FROM_CHECKPOINT_FIELDS & request.model_fields_set)
        if given:
            raise InvalidRequestError(f"{', '.join(given)}: taken from the checkpoint; leave out with from_checkpoint")
        with services.sessions() as db:  # 404 for a missing checkpoint or another tenant's
            checkpoint = resolve_checkpoint(db, tenant.id, request.from_checkpoint, request.with_optimizer)
            source = AdapterRepository(db, tenant.id).get(checkpoint.model_id, include_deleted=True)
        if not set(source.target_modules) <= set(served.target_modules) or source.base_model != base_model:
            raise InvalidRequestError(f"{request.from_checkpoint} was trained for another base model or target modules")
        rank, alpha, seed = source.rank, source.alpha, source.seed
        target_modules = tuple(source.target_modules)
        from_checkpoint = FromCheckpoint(
            path=request.from_checkpoint,
            directory=str(checkpoint_dir(services, checkpoint)),
            with_optimizer=request.with_optimizer,
        )
    if rank > served.max_rank:
        raise InvalidRequestError(f"rank {rank} exceeds this pool's maximum rank {served.max_rank}")
    alpha = alpha if alpha is not None else ALPHA_PER_RANK * rank
    seed = seed if seed is not None else secrets.randbelow(SEED_LIMIT)
    modules = _modules(served.target_modules, target_modules or request.target_modules)
    model_id = model_id or uuid.uuid4().hex
    with write_session(services) as db:  # committed before the worker can report on it (the quota counted in it)
        adapters = AdapterRepository(db, tenant.id)
        own = tenant.quotas.max_adapters
        quota = settings.max_adapters_per_tenant if own is None else own
        if quota and adapters.count_live() >= quota:
            named = "LORAPLEX_MAX_ADAPTERS_PER_TENANT" if own is None else "set by an operator"
            raise QuotaExceededError(  # no retry_after: waiting frees nothing, a delete does
                f"tenant {tenant.name} has {quota} adapters, its quota ({named}): delete one first"
            )
        pool = place(db, served)
        adapters.create(
            model_id=model_id,
            base_model=base_model,
            rank=rank,
            alpha=alpha,
            target_modules=list(modules),
            seed=seed,
            session_id=session_id,
            user_metadata=request.user_metadata,
            pool=pool,
        )
        # seq_id 0 stands for the creation: the adapter's first step is seq_id 1, whatever order steps arrive in.
        adapters.record_applied(model_id, 0)
    payload = CreateAdapterPayload(
        base_model=base_model,
        rank=rank,
        alpha=alpha,
        seed=seed,
        target_modules=modules,
        from_checkpoint=from_checkpoint,
    )
    return submit(services, tenant, model_id, RequestKind.CREATE_ADAPTER, payload, pool=pool)


def served_models(services: Services) -> list[ServedModel]:
    """Every base model a live pool serves (with the gateway's own pool's while none does), by name."""
    served = fleet(services)
    return [served.models[name] for name in served.names]


def served_model(services: Services, base_model: str | None) -> ServedModel:
    """The served base model a request names (none named: the gateway's own base model while it is served, else the
    first served one); InvalidRequestError (400) naming the served models otherwise."""
    served = fleet(services)
    if base_model is None:
        default = services.settings.base_model
        base_model = default if default in served.models or not served.names else served.names[0]
    return served.model(base_model)


def place(db: Session, served: ServedModel) -> str:
    """The pool of `served` a new adapter goes to, by the placement rule (service/placement.py) over each pool's
    live adapters counted now, in the creating transaction (which holds the pools' rows on PostgreSQL), and its
    queued tokens as it last registered; drained pools take none (ServiceUnavailableError when every one is)."""
    return choose_pool_or_503(pool_loads(db, served), served.name)


def pool_loads(db: Session, served: ServedModel) -> list[PoolLoad]:
    """The placement rule's view of each pool of `served`: slots, live adapters placed on it, queued tokens, drained."""
    pools = PoolRepository(db)
    placed = pools.placed_adapters(served.pool_names)
    draining = pools.draining(served.pool_names)
    return [PoolLoad(p.name, p.slots, placed[p.name], p.queued_tokens, p.name in draining) for p in served.pools]


def choose_pool_or_503(loads: list[PoolLoad], base_model: str) -> str:
    try:
        return choose_pool(loads)
    except ValueError:
        raise ServiceUnavailableError(
            f"every pool of {base_model!r} is drained ({', '.join(p.name for p in loads)}): undrain one "
            "(`loraplex pool undrain NAME`) or start another"
        ) from None


def _modules(pool: tuple[str, ...], asked: Sequence[str] | None) -> tuple[str, ...]:
    """The pool's target modules an adapter trains: all of them, or the subset asked for (in the pool's order)."""
    if not asked:
        return tuple(pool)
    unknown = sorted(set(asked) - set(pool))
    if unknown:
        raise InvalidRequestError(f"target_modules {unknown} are not among this pool's {list(pool)}")
    return tuple(m for m in pool if m in set(asked))


def _resubmit_create(services: Services, tenant: TenantRef, model_id: str) -> FutureRef | None:
    """The first creation's future when `model_id` was created already (None when it is new). The request queued
    under (model_id, create) answers it; a deleted adapter's id is not reused."""
    with services.sessions() as db:
        adapter = AdapterRepository(db, tenant.id).find(model_id)
    if adapter is None:
        return None
    if adapter.status == AdapterStatus.DELETED:
        raise ConflictError(f"adapter {model_id!r} was created and deleted; its id is not reused")
    request_id = existing_request_id(services, RequestKind.CREATE_ADAPTER, model_id)
    if request_id is None:  # its idempotency key expired: the adapter is long created
        raise ConflictError(f"adapter {model_id!r} already exists")
    return FutureRef(request_id=request_id, model_id=model_id)


def list_adapters(services: Services, tenant: TenantRef) -> list[AdapterOut]:
    with services.sessions() as db:
        return [adapter_out(a) for a in AdapterRepository(db, tenant.id).list()]


def get_adapter(services: Services, tenant: TenantRef, model_id: str) -> AdapterOut:
    with services.sessions() as db:
        return adapter_out(AdapterRepository(db, tenant.id).get(model_id))


def delete_adapter(services: Services, tenant: TenantRef, model_id: str) -> FutureRef:
    with write_session(services) as db:
        pool = AdapterRepository(db, tenant.id).mark_deleted(model_id).pool
    return submit(services, tenant, model_id, RequestKind.DELETE_ADAPTER, DeleteAdapterPayload(), pool=pool)
