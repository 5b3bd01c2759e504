"""What the dashboard shows, read at page load: queue depth per tenant (Redis), GPU slots in use per pool and adapters
per tier (the residency rows), training tokens per second per tenant over the last minutes (the usage rows, in
buckets), the pool's plan totals (queue/stats.py: forward_backward steps and adapters per step), and from the pools'
published metrics (service/pool_metrics_reader.py) the swaps per tier move and the forward_backward steps per layout (mixed or
single adapter: the plan's choice)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, select

from loraplex.queue import stats
from loraplex.queue.depth import queue_depths
from loraplex.service.context import Services
from loraplex.service.pool_metrics_reader import pool_metric_families
from loraplex.storage.enums import PipelineState, ResidencyTier
from loraplex.storage.models import Pipeline, Pool, Residency, Tenant, Usage
from loraplex.storage.types import utcnow

WINDOW_S = 15 * 60  # the tokens/s chart's span
BUCKET_S = 30
TRAINING_KINDS = ("forward_backward", "forward")
ACTIVE = (PipelineState.QUEUED, PipelineState.RUNNING)


@dataclass
class DashboardData:
    now: datetime
    queue: list[tuple[str, float]] = field(default_factory=list)  # (tenant name, queued requests)
    slots: list[tuple[str, float, float]] = field(default_factory=list)  # (pool, GPU slots in use, slots)
    tiers: list[tuple[str, float]] = field(default_factory=list)  # (tier, adapters)
    tokens_per_s: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # tenant -> (t - now, tok/s)
    plans: list[tuple[str, float]] = field(default_factory=list)  # plan totals of the gateway's pool
    swaps: list[tuple[str, float]] = field(default_factory=list)  # (move, count) summed over pools
    layouts: list[tuple[str, float]] = field(default_factory=list)  # (mixed | single, forward_backward steps)
    pipelines: list[tuple[str, float, float]] = field(default_factory=list)  # (tenant/name [state], step, total)


def read_dashboard(services: Services) -> DashboardData:
    now = utcnow()
    data = DashboardData(now=now)
    with services.sessions() as db:
        names = dict(db.execute(select(Tenant.id, Tenant.name)).tuples().all())
        pools = db.execute(select(Pool.name, Pool.slots)).tuples().all()
        gpu = dict(
            db.execute(select(Residency.pool, func.count()).where(Residency.tier == ResidencyTier.GPU).group_by(Residency.pool))
            .tuples()
            .all()
        )
        data.slots = [(name, float(gpu.get(name, 0)), float(slots)) for name, slots in sorted(pools)]
        tiers = db.execute(select(Residency.tier, func.count()).group_by(Residency.tier)).tuples().all()
        data.tiers = sorted((str(t), float(n)) for t, n in tiers)
        recent = db.execute(
            select(Pipeline.tenant_id, Pipeline.name, Pipeline.state, Pipeline.step, Pipeline.total_steps)
            .where(Pipeline.state.in_(ACTIVE) | (Pipeline.finished_at >= now - timedelta(seconds=WINDOW_S)))
            .order_by(Pipeline.created_at.desc())
            .limit(12)
        ).tuples()
        data.pipelines = [
            (f"{names.get(t, t)}/{name} [{state}]", float(step), float(max(total, 1)))
            for t, name, state, step, total in recent
        ]
        since = now - timedelta(seconds=WINDOW_S)
        rows = db.execute(
            select(Usage.tenant_id, Usage.created_at, Usage.tokens).where(
                Usage.created_at >= since, Usage.kind.in_(TRAINING_KINDS)
            )
        ).tuples()
        buckets: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for tenant_id, at, tokens in rows:
            buckets[names.get(tenant_id, tenant_id)][int((at - since).total_seconds() // BUCKET_S)] += tokens
    for tenant, by_bucket in buckets.items():
        data.tokens_per_s[tenant] = [
            ((b + 0.5) * BUCKET_S - WINDOW_S, by_bucket.get(b, 0.0) / BUCKET_S) for b in range(WINDOW_S // BUCKET_S)
        ]
    pool = services.settings.pool
    depths = queue_depths(services.redis, pool)
    data.queue = sorted(((names.get(t, t), float(n)) for t, n in depths.items()), key=lambda x: (-x[1], x[0]))[:12]
    totals = stats.read(services.redis, pool)
    data.plans = [
        ("plans", float(totals.plans)),
        ("forward_backward steps", float(totals.fb_steps)),
        ("adapters per step", round(totals.adapters_per_fb_step, 2)),
        ("optimizer steps", float(totals.optim_steps)),
    ]
    data.swaps = _summed(services, "loraplex_pool_swaps", "move")
    data.layouts = _summed(services, "loraplex_pool_fb_steps", "layout")
    return data


def _summed(services: Services, family: str, label: str) -> list[tuple[str, float]]:
    """A counter family of the pools' published metrics, summed over pools by one label."""
    totals: dict[str, float] = defaultdict(float)
    for metric in pool_metric_families(services.redis):
        if metric.name == family:
            for sample in metric.samples:
                if sample.name == family + "_total":
                    totals[sample.labels.get(label, "")] += sample.value
    return sorted(totals.items())
