"""What the dashboard shows, read at each poll: the fleet's timeline over the chosen range (queue/timeline.py, shaped
by admin/dashboard_shaping.py), the health of every pool (the pools table: heartbeat, state, draining; Redis: its
leader lease and registration), of the gateways (their last timeline report) and of Redis (a PING, its memory), the
usage rows' totals per tenant over the range, GPU slots and tiers (the residency rows), the pipelines, the plan totals
of the gateway's pool (queue/stats.py) and the swaps and layouts the pools publish (service/pool_metrics_reader.py).
Tenants and adapters by name: tenant names from the tenants table, adapters as <tenant>/<short id>."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import redis as redis_lib
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from loraplex.admin.dashboard_shaping import Alert, Shaped, alerts, shape
from loraplex.queue import keys, stats, timeline
from loraplex.queue.depth import queue_depths
from loraplex.queue.redis_text import text
from loraplex.queue.timeline import TimelineEntry
from loraplex.service.context import Services
from loraplex.service.pool_health import all_pools, short_error
from loraplex.service.pool_metrics_reader import pool_metric_families
from loraplex.storage.enums import PipelineState, ResidencyTier
from loraplex.storage.models import Adapter, Pipeline, Pool, Residency, Tenant, Usage
from loraplex.storage.types import utcnow

ACTIVE = (PipelineState.QUEUED, PipelineState.RUNNING)
ADAPTERS_SHOWN = 12


@dataclass
class PipelineRow:
    label: str
    state: str
    step: int
    total: int
    train_losses: list[tuple[float, float]]
    eval_losses: list[tuple[float, float]]


@dataclass
class AdapterRow:
    model_id: str
    label: str
    tenant: str
    status: str
    applied_seq_id: int | None
    fb_steps: int  # in the range
    optim_steps: int
    last_loss: float | None
    loss: list[tuple[float, float]]


@dataclass
class DashboardData:
    now: float
    range_s: int
    shaped: Shaped
    alerts: list[Alert] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)
    gateways: list[dict[str, Any]] = field(default_factory=list)
    redis: dict[str, Any] = field(default_factory=dict)
    database: dict[str, Any] = field(default_factory=dict)
    usage: list[tuple[str, int, float, int]] = field(default_factory=list)  # (tenant, tokens, seconds, records)
    queue: list[tuple[str, float]] = field(default_factory=list)  # (tenant, queued requests now)
    slots: list[tuple[str, float, float]] = field(default_factory=list)  # (pool, GPU slots in use, slots)
    tiers: list[tuple[str, float]] = field(default_factory=list)
    plans: list[tuple[str, float]] = field(default_factory=list)
    swaps: list[tuple[str, float]] = field(default_factory=list)
    layouts: list[tuple[str, float]] = field(default_factory=list)
    pipelines: list[PipelineRow] = field(default_factory=list)
    adapters: list[AdapterRow] = field(default_factory=list)


class TimelineCache:
    """This process's copy of the timeline's last hours: each poll reads only the entries added since the last one."""

    def __init__(self, keep_s: float = timeline.KEEP_S) -> None:
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._entries: list[TimelineEntry] = []

    def since(self, redis: redis_lib.Redis, start: float) -> list[TimelineEntry]:
        with self._lock:
            last = self._entries[-1].id if self._entries else None
            fresh = timeline.read(redis, after_id=last, since=None if last else time.time() - self.keep_s)
            self._entries.extend(fresh)
            cutoff = time.time() - self.keep_s
            if self._entries and self._entries[0].at < cutoff:
                self._entries = [e for e in self._entries if e.at >= cutoff]
            return [e for e in self._entries if e.at >= start]


CACHE = TimelineCache()


def adapter_label(tenant: str, model_id: str) -> str:
    return f"{tenant}/{model_id[:8]}"


def read_dashboard(services: Services, range_s: int, cache: TimelineCache = CACHE) -> DashboardData:
    now = time.time()
    start = now - range_s
    redis = services.redis
    names: dict[str, str] = {}
    data = DashboardData(now=now, range_s=range_s, shaped=shape([], now, range_s))
    try:
        with services.sessions() as db:
            names = dict(db.execute(select(Tenant.id, Tenant.name)).tuples().all())
            _read_sql(db, data, names, start)
        data.database = {"ok": True}
    except SQLAlchemyError as exc:
        data.database = {"ok": False, "error": short_error(exc)}
    try:
        t0 = time.perf_counter()
        redis.ping()
        info = redis.info("memory")
        data.redis = {"ok": True, "ping_ms": (time.perf_counter() - t0) * 1e3,
                      "used_memory": int(info.get("used_memory", 0))}  # fmt: skip
        entries = cache.since(redis, start)
        data.shaped = shape(entries, now, range_s, names)
        gateways = timeline.gateways(redis)
        data.gateways = [{"name": n, "age_s": now - float(r.get("at", 0)), **r} for n, r in sorted(gateways.items())]
        _read_redis(services, data, names)
    except redis_lib.RedisError as exc:
        data.redis = {"ok": False, "error": short_error(exc)}
        gateways = {}
    if data.database.get("ok"):
        try:
            data.pools = _pool_health(services, data)
        except SQLAlchemyError as exc:
            data.database = {"ok": False, "error": short_error(exc)}
    data.alerts = alerts(data.shaped, data.pools, gateways, bool(data.redis.get("ok")), now)
    if not data.database.get("ok"):
        data.alerts.insert(0, Alert("danger", f"database: {data.database.get('error')}"))
    _adapter_rows(data)
    with suppress(SQLAlchemyError):  # the ids stand in for the labels; the database's trouble is an alert already
        label_adapters(services, data)
    return data


def _read_sql(db: Any, data: DashboardData, names: dict[str, str], start: float) -> None:
    since = utcnow() - timedelta(seconds=data.range_s)
    pools = db.execute(select(Pool.name, Pool.slots)).tuples().all()
    gpu = dict(db.execute(select(Residency.pool, func.count()).where(Residency.tier == ResidencyTier.GPU)
                          .group_by(Residency.pool)).tuples().all())  # fmt: skip
    data.slots = [(name, float(gpu.get(name, 0)), float(slots)) for name, slots in sorted(pools)]
    tiers = db.execute(select(Residency.tier, func.count()).group_by(Residency.tier)).tuples().all()
    data.tiers = sorted((str(t), float(n)) for t, n in tiers)
    usage = db.execute(select(Usage.tenant_id, func.sum(Usage.tokens), func.sum(Usage.seconds), func.count())
                       .where(Usage.created_at >= since).group_by(Usage.tenant_id)).tuples().all()  # fmt: skip
    data.usage = sorted(((names.get(t, t), int(k or 0), float(s or 0.0), int(c)) for t, k, s, c in usage),
                        key=lambda u: (-u[1], u[0]))  # fmt: skip
    recent = db.execute(
        select(Pipeline.tenant_id, Pipeline.name, Pipeline.state, Pipeline.step, Pipeline.total_steps,
               Pipeline.train_losses, Pipeline.eval_losses)
        .where(Pipeline.state.in_(ACTIVE) | (Pipeline.finished_at >= since))
        .order_by(Pipeline.created_at.desc())
        .limit(8)
    ).tuples()  # fmt: skip
    data.pipelines = [
        PipelineRow(f"{names.get(t, t)}/{name}", str(state), int(step), int(max(total, 1)),
                    [(float(a), float(b)) for a, b in (train or [])], [(float(a), float(b)) for a, b in (ev or [])])
        for t, name, state, step, total, train, ev in recent
    ]  # fmt: skip


def _read_redis(services: Services, data: DashboardData, names: dict[str, str]) -> None:
    pool = services.settings.pool
    depths: dict[str, float] = defaultdict(float)
    for p in {pool, *data.shaped.pool_last, *(name for name, _, _ in data.slots)}:
        for tenant, n in queue_depths(services.redis, p).items():
            depths[names.get(tenant, tenant)] += n
    data.queue = sorted(((t, n) for t, n in depths.items()), key=lambda x: (-x[1], x[0]))[:12]
    totals = stats.read(services.redis, pool)
    data.plans = [("plans", float(totals.plans)), ("forward_backward steps", float(totals.fb_steps)),
                  ("adapters per step", round(totals.adapters_per_fb_step, 2)),
                  ("optimizer steps", float(totals.optim_steps))]  # fmt: skip
    data.swaps = _summed(services, "loraplex_pool_swaps", "move")
    data.layouts = _summed(services, "loraplex_pool_fb_steps", "layout")


def _pool_health(services: Services, data: DashboardData) -> list[dict[str, Any]]:
    """Every pool: its heartbeat and state (pool_health), draining, its leader lease (holder, seconds left)."""
    health = all_pools(services.settings, services.sessions)
    with services.sessions() as db:
        draining = dict(db.execute(select(Pool.name, Pool.draining)).tuples().all())
    leases: dict[str, tuple[str | None, float | None]] = {}
    try:
        pipe = services.redis.pipeline(transaction=False)
        for p in health:
            pipe.get(keys.pool_leader(p.name))
            pipe.pttl(keys.pool_leader(p.name))
        replies = pipe.execute()
        for i, p in enumerate(health):
            holder, ttl = replies[2 * i], replies[2 * i + 1]
            leases[p.name] = (
                text(holder).split(" ", 1)[-1] if holder else None,
                ttl / 1000 if ttl and ttl > 0 else None,
            )
    except redis_lib.RedisError:  # Redis away: the leases show as unknown; the health table's Redis row says why
        pass
    out = []
    for p in health:
        holder, ttl = leases.get(p.name, (None, None))
        last = data.shaped.pool_last.get(p.name)
        out.append({**p.as_dict(), "draining": bool(draining.get(p.name)), "lease_holder": holder, "lease_ttl_s": ttl,
                    "reported_age_s": None if last is None else data.now - last,
                    "memory": data.shaped.memory.get(p.name, {})})  # fmt: skip
    return out


def _adapter_rows(data: DashboardData) -> None:
    """The adapters that trained in the range (most steps first), with their loss by step and their progress."""
    shaped = data.shaped
    ranked = sorted(shaped.adapter_steps.items(), key=lambda kv: (-(kv[1][1] + kv[1][2]), kv[0]))[:ADAPTERS_SHOWN]
    data.adapters = []
    for model_id, (tenant_id, fb, optim) in ranked:
        points = shaped.loss.get(model_id, [])
        data.adapters.append(AdapterRow(model_id, model_id, tenant_id, "", None, fb, optim,
                                        points[-1][1] if points else None, points))  # fmt: skip


def label_adapters(services: Services, data: DashboardData) -> None:
    """The adapters' readable labels, statuses and applied seq_ids (one query)."""
    if not data.adapters:
        return
    ids = [a.model_id for a in data.adapters]
    with services.sessions() as db:
        rows = db.execute(select(Adapter.model_id, Tenant.name, Adapter.status, Adapter.applied_seq_id)
                          .join(Tenant, Tenant.id == Adapter.tenant_id)
                          .where(Adapter.model_id.in_(ids))).tuples().all()  # fmt: skip
    found = {m: (name, str(status), seq) for m, name, status, seq in rows}
    for a in data.adapters:
        name, status, seq = found.get(a.model_id, (a.tenant, "", None))
        a.tenant, a.label, a.status, a.applied_seq_id = name, adapter_label(name, a.model_id), status, seq


def _summed(services: Services, family: str, label: str) -> list[tuple[str, float]]:
    """A counter family of the pools' published metrics, summed over pools by one label."""
    totals: dict[str, float] = defaultdict(float)
    for metric in pool_metric_families(services.redis):
        if metric.name == family:
            for sample in metric.samples:
                if sample.name == family + "_total":
                    totals[sample.labels.get(label, "")] += sample.value
    return sorted(totals.items())
