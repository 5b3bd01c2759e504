"""Training runs: Tinker's view of an adapter (its model_id is the training_run_id), with its newest checkpoints.
Runs stay readable and listed after their adapter is deleted (`status` says so), like their checkpoints."""

from __future__ import annotations

from loraplex.protocol.checkpoint_paths import CheckpointKind
from loraplex.service.checkpoints import checkpoint_out
from loraplex.service.context import Services, TenantRef
from loraplex.service.paging import check_page, cursor
from loraplex.service.schemas import RunOut, RunPage
from loraplex.storage.models import Adapter, Checkpoint
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository


def run_out(tenant: TenantRef, adapter: Adapter, latest: dict[tuple[str, CheckpointKind], Checkpoint]) -> RunOut:
    """`latest`: the newest checkpoint of each (model_id, kind), as CheckpointRepository.latest_of answers."""
    state = latest.get((adapter.model_id, CheckpointKind.STATE))
    sampler = latest.get((adapter.model_id, CheckpointKind.SAMPLER))
    return RunOut(
        training_run_id=adapter.model_id,
        base_model=adapter.base_model,
        model_owner=tenant.name,
        lora_rank=adapter.rank,
        last_request_time=adapter.last_used_at or adapter.created_at,
        last_checkpoint=checkpoint_out(state) if state is not None else None,
        last_sampler_checkpoint=checkpoint_out(sampler) if sampler is not None else None,
        user_metadata=dict(adapter.user_metadata or {}),
        status=str(adapter.status),
        applied_seq_id=adapter.applied_seq_id,
        session_id=adapter.session_id,
    )


def get_run(services: Services, tenant: TenantRef, model_id: str) -> RunOut:
    """The tenant's run `model_id` (a deleted one too); 404 for a missing or another tenant's."""
    with services.sessions() as db:
        adapter = AdapterRepository(db, tenant.id).get(model_id, include_deleted=True)
        return run_out(tenant, adapter, CheckpointRepository(db, tenant.id).latest_of([model_id]))


def list_runs(services: Services, tenant: TenantRef, limit: int, offset: int) -> RunPage:
    """The tenant's runs (deleted ones too), newest first; 400 for a limit outside 1..1000 or a negative offset."""
    check_page(limit, offset)
    with services.sessions() as db:
        adapters = AdapterRepository(db, tenant.id)
        total = adapters.count(include_deleted=True)
        page = adapters.page(limit, offset, include_deleted=True)
        latest = CheckpointRepository(db, tenant.id).latest_of(a.model_id for a in page)
        runs = [run_out(tenant, a, latest) for a in page]
    return RunPage(training_runs=runs, cursor=cursor(limit, offset, total))
