"""The dashboard's numbers from the fleet's timeline (queue/timeline.py): pure functions, entries in, series out.

A time range is cut into buckets (`bucket_for`: 2 s for the last 5 minutes, coarser for longer ranges, about 150 per
range); each series is one value per bucket: rates per second (responses by status class, failed futures, training
tokens per tenant), percentiles of the histograms merged over the bucket (queue wait, compute), the last value seen
(a tenant's queue); an adapter's loss by its steps' seq_ids, so a finished job draws its whole curve. `alerts` reads what is wrong and since when."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.queue import latency_histogram
from loraplex.queue.timeline import GATEWAY, POOL, TimelineEntry

RANGES = {"5m": 300, "15m": 900, "1h": 3600, "6h": 6 * 3600}
DEFAULT_RANGE = "15m"
NICE_BUCKETS = (2, 5, 10, 15, 30, 60, 120, 180, 300)
TARGET_BUCKETS = 150

Series = list[tuple[float, float]]  # (unix seconds: the bucket's middle, value)


def bucket_for(range_s: float) -> int:
    """The finest nice bucket that keeps the range within about TARGET_BUCKETS buckets."""
    return next((b for b in NICE_BUCKETS if range_s / b <= TARGET_BUCKETS), NICE_BUCKETS[-1])


@dataclass
class Shaped:
    start: float
    end: float
    bucket_s: int
    status: dict[str, Series] = field(default_factory=dict)  # "4xx", "429", "5xx", "failed futures" -> per second
    status_totals: dict[str, int] = field(default_factory=dict)
    first_seen: dict[str, float] = field(default_factory=dict)  # the same keys -> the first bucket holding some
    last_seen: dict[str, float] = field(default_factory=dict)
    latency: dict[str, Series] = field(default_factory=dict)  # "queue wait p50"... -> seconds
    latency_totals: dict[str, float | None] = field(default_factory=dict)
    tokens: dict[str, Series] = field(default_factory=dict)  # tenant -> training tokens/s
    tenant_totals: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> ok, failed, tokens, p50, p99
    queued: dict[str, Series] = field(default_factory=dict)  # tenant -> requests queued (the bucket's largest)
    loss: dict[str, Series] = field(default_factory=dict)  # model_id -> (seq_id, loss:sum) of its steps in the range
    adapter_steps: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # model_id -> (tenant, fb, optim)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # pool -> its latest gauges
    pool_last: dict[str, float] = field(default_factory=dict)  # pool -> its latest entry's time
    gateway_latency: dict[str, Series] = field(default_factory=dict)  # "p50", "p99" of the gateways' short calls


def shape(entries: Sequence[TimelineEntry], now: float, range_s: float, tenant_names: Mapping[str, str] | None = None
          ) -> Shaped:  # fmt: skip
    names = tenant_names or {}
    bucket = bucket_for(range_s)
    start = now - range_s
    n = int(range_s // bucket) + 1
    out = Shaped(start, now, bucket)

    def index(at: float) -> int | None:
        i = int((at - start) // bucket)
        return i if 0 <= i < n else None

    def middle(i: int) -> float:
        return start + (i + 0.5) * bucket

    counts: dict[str, list[float]] = {k: [0.0] * n for k in ("4xx", "429", "5xx", "failed futures")}
    waits: list[list[Mapping[int | str, int]]] = [[] for _ in range(n)]
    computes: list[list[Mapping[int | str, int]]] = [[] for _ in range(n)]
    gw_lat: list[list[Mapping[int | str, int]]] = [[] for _ in range(n)]
    tokens: dict[str, list[float]] = {}
    queued: dict[str, list[float | None]] = {}
    loss: dict[str, dict[float, float]] = {}
    tenant_waits: dict[str, list[Mapping[int | str, int]]] = {}
    totals: dict[str, dict[str, float]] = {}
    for e in entries:
        if e.src == POOL:
            out.pool_last[e.name] = max(out.pool_last.get(e.name, 0.0), e.at)
            gauges = {k: float(v) for k, v in e.data.items() if isinstance(v, int | float)}
            if gauges:
                out.memory[e.name] = gauges
        i = index(e.at)
        if i is None:
            continue
        d = e.data
        if e.src == GATEWAY:
            for cls, k in (d.get("status") or {}).items():
                if cls in counts:
                    counts[cls][i] += k
            gw_lat[i].append(d.get("latency") or {})
            continue
        if e.src != POOL:
            continue
        waits[i].append(d.get("wait") or {})
        computes[i].append(d.get("compute") or {})
        for tenant_id, (ok, failed) in (d.get("requests") or {}).items():
            name = names.get(tenant_id, tenant_id)
            counts["failed futures"][i] += failed
            t = totals.setdefault(name, {"ok": 0, "failed": 0, "tokens": 0})
            t["ok"] += ok
            t["failed"] += failed
        for tenant_id, k in (d.get("tokens") or {}).items():
            name = names.get(tenant_id, tenant_id)
            tokens.setdefault(name, [0.0] * n)[i] += k / bucket
            totals.setdefault(name, {"ok": 0, "failed": 0, "tokens": 0})["tokens"] += k
        for tenant_id, hist in (d.get("wait_by_tenant") or {}).items():
            tenant_waits.setdefault(names.get(tenant_id, tenant_id), []).append(hist)
        for tenant_id, k in (d.get("queued") or {}).items():
            depth = queued.setdefault(names.get(tenant_id, tenant_id), [None] * n)
            depth[i] = max(depth[i] or 0, k)
        for model_id, (tenant_id, _, fb, optim, *rest) in (d.get("adapters") or {}).items():
            for seq_id, value in rest[0] if rest else ():
                loss.setdefault(model_id, {})[float(seq_id)] = value
            have = out.adapter_steps.get(model_id, (tenant_id, 0, 0))
            out.adapter_steps[model_id] = (tenant_id, have[1] + fb, have[2] + optim)
    for k, row in counts.items():
        out.status[k] = [(middle(i), v / bucket) for i, v in enumerate(row)]
        out.status_totals[k] = int(sum(row))
        hits = [i for i, v in enumerate(row) if v]
        if hits:
            out.first_seen[k], out.last_seen[k] = start + hits[0] * bucket, start + (hits[-1] + 1) * bucket
    for label, hists, q in (("queue wait p50", waits, 0.5), ("queue wait p99", waits, 0.99),
                            ("compute p50", computes, 0.5), ("compute p99", computes, 0.99)):  # fmt: skip
        out.latency[label] = _percentile_series(hists, q, middle)
        out.latency_totals[label] = latency_histogram.percentile(latency_histogram.merge(_flat(hists)), q)
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        out.gateway_latency[label] = _percentile_series(gw_lat, q, middle)
    out.tokens = {t: [(middle(i), v) for i, v in enumerate(row)] for t, row in sorted(tokens.items())}
    out.queued = {t: [(middle(i), v) for i, v in enumerate(d) if v is not None] for t, d in sorted(queued.items())}
    out.loss = {m: sorted(points.items()) for m, points in loss.items()}
    for name, tenant_hists in tenant_waits.items():
        merged = latency_histogram.merge(tenant_hists)
        t = totals.setdefault(name, {"ok": 0, "failed": 0, "tokens": 0})
        t["wait p50"] = latency_histogram.percentile(merged, 0.5) or 0.0
        t["wait p99"] = latency_histogram.percentile(merged, 0.99) or 0.0
    out.tenant_totals = dict(sorted(totals.items()))
    return out


def _flat(buckets: Iterable[list[Mapping[int | str, int]]]) -> list[Mapping[int | str, int]]:
    return [h for row in buckets for h in row]


def _percentile_series(hists: Sequence[list[Mapping[int | str, int]]], q: float, middle: Any) -> Series:
    out: Series = []
    for i, row in enumerate(hists):
        value = latency_histogram.percentile(latency_histogram.merge(row), q) if row else None
        if value is not None:
            out.append((middle(i), value))
    return out


@dataclass(frozen=True)
class Alert:
    level: str  # "danger" or "warning"
    text: str
    since: float | None = None  # unix seconds
    last: float | None = None


def alerts(shaped: Shaped, pools: Sequence[Mapping[str, Any]], gateways: Mapping[str, Mapping[str, Any]],
           redis_ok: bool, now: float, gateway_silent_s: float = 30.0) -> list[Alert]:  # fmt: skip
    """What is wrong now, worst first: Redis, pools down or draining, silent gateways, 5xx, failed futures, 429s."""
    out: list[Alert] = []
    if not redis_ok:
        out.append(Alert("danger", "Redis does not answer: nothing can be queued or answered"))
    for p in pools:
        if not p.get("ok"):
            age = p.get("heartbeat_age_s")
            out.append(Alert("danger", str(p.get("reason") or f"pool {p.get('name')} is down"),
                             now - age if isinstance(age, int | float) else None))  # fmt: skip
        elif p.get("draining"):
            out.append(Alert("warning", f"pool {p.get('name')} is draining"))
    for name, report in gateways.items():
        silent = now - float(report.get("at", 0))
        if silent > gateway_silent_s:
            out.append(Alert("warning", f"gateway {name} silent for {silent:.0f} s", float(report.get("at", 0))))
    for key, level, what in (("5xx", "danger", "server errors (5xx)"), ("failed futures", "danger", "failed futures"),
                             ("429", "warning", "rejections (429)"), ("4xx", "warning", "client errors (4xx)")):  # fmt: skip
        total = shaped.status_totals.get(key, 0)
        if total:
            out.append(Alert(level, f"{total} {what} in this range", shaped.first_seen.get(key),
                             shaped.last_seen.get(key)))  # fmt: skip
    return out
