"""What belongs to a tenant or an adapter, for the admin's detail pages: a tenant's keys, adapters, usage totals,
checkpoint holdings and queued requests per pool; an adapter's checkpoints. Reads only; rows come back detached."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select

from loraplex.queue.depth import tenant_queue_depth
from loraplex.service.context import Services
from loraplex.storage.enums import AdapterStatus
from loraplex.storage.models import Adapter, ApiKey, Checkpoint
from loraplex.storage.repositories import CheckpointRepository, PoolRepository, TenantRepository, UsageRepository
from loraplex.storage.repositories.usage import UsageTotals

ADAPTERS_SHOWN = 50  # newest first; the adapters list, searched by the tenant's name, has them all


@dataclass
class TenantOverview:
    keys: list[ApiKey]
    adapters: list[Adapter]
    live_adapters: int
    usage: UsageTotals
    checkpoints: int
    checkpoint_bytes: int
    queued: dict[str, int] = field(default_factory=dict)  # pool -> requests queued there

    @property
    def queued_total(self) -> int:
        return sum(self.queued.values())


def tenant_overview(services: Services, tenant_id: str) -> TenantOverview:
    with services.sessions() as db:
        keys = TenantRepository(db).list_keys(tenant_id)
        adapters = list(db.scalars(select(Adapter).where(Adapter.tenant_id == tenant_id)
                                   .order_by(Adapter.created_at.desc()).limit(ADAPTERS_SHOWN)))  # fmt: skip
        live = db.scalar(select(func.count()).select_from(Adapter)
                         .where(Adapter.tenant_id == tenant_id, Adapter.status != AdapterStatus.DELETED))  # fmt: skip
        usage = UsageRepository(db, tenant_id).totals()
        count, size = CheckpointRepository(db, tenant_id).usage()
        pools = sorted({p.name for p in PoolRepository(db).list()} | {services.settings.pool})
        db.expunge_all()
    queued = tenant_queue_depth(services.redis, pools, tenant_id)
    return TenantOverview(keys, adapters, int(live or 0), usage, count, size, queued)


def adapter_checkpoints(services: Services, model_id: str) -> list[Checkpoint]:
    """The adapter's checkpoints, newest first."""
    with services.sessions() as db:
        rows = list(db.scalars(select(Checkpoint).where(Checkpoint.model_id == model_id)
                               .order_by(Checkpoint.created_at.desc(), Checkpoint.name)))  # fmt: skip
        db.expunge_all()
        return rows



def tenant_names(services: Services) -> list[tuple[str, str]]:
    """(id, name) of every tenant: what the pools' metrics label by id, named (api/metrics.tenant_info_exposition)."""
    with services.sessions() as db:
        return [(t.id, t.name) for t in TenantRepository(db).list()]
