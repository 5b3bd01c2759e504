"""The dashboard's panels as HTML fragments (pure: DashboardData in, markup out; every name escaped). The page draws
them at load and its script swaps them in at each poll of /admin/dashboard/data (admin/dashboard.py)."""

from __future__ import annotations

from html import escape
from typing import Any

from loraplex.admin import charts
from loraplex.admin.charts import clock, seconds_label
from loraplex.admin.dashboard_data import DashboardData

GiB = 1024**3


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _age(s: float | None) -> str:
    return "-" if s is None else (f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min")


def _badge(ok: bool, text: str) -> str:
    return f'<span class="badge {"bg-green" if ok else "bg-red"} text-white">{escape(text)}</span>'


def alerts_html(data: DashboardData) -> str:
    if not data.alerts:
        return (
            '<div class="alert alert-success mb-2" id="all-clear">Nothing wrong in this range: every pool, '
            "gateway and Redis up; no 5xx, no failed futures, no rejections.</div>"
        )
    items = []
    for a in data.alerts:
        when = []
        if a.since is not None:
            when.append(f"since {clock(a.since)}")
        if a.last is not None:
            when.append(f"last {clock(a.last)}")
        suffix = f' <span class="text-muted">({", ".join(when)} UTC)</span>' if when else ""
        items.append(f'<div class="alert alert-{a.level} py-1 px-2 mb-1">{escape(a.text)}{suffix}</div>')
    return "".join(items)


def health_html(data: DashboardData) -> str:
    rows = []
    for p in data.pools:
        state = "draining" if p.get("draining") else ("up" if p.get("ok") else "down")
        mem = p.get("memory") or {}
        gpu = mem.get("gpu_memory_allocated_bytes")
        gpu_text = f"{_size(gpu)} / {_size(mem.get('gpu_memory_total_bytes'))}" if gpu is not None else "cpu"
        lease = (
            f"{escape(str(p.get('lease_holder') or '-'))[:28]} ({_age(p.get('lease_ttl_s'))} left)"
            if p.get("lease_holder")
            else "none"
        )
        disk = mem.get("checkpoint_disk_free_bytes")
        rows.append(f"<tr><td>pool <b>{escape(p['name'])}</b></td><td>{_badge(state != 'down', state)}</td>"
                    f"<td>heartbeat {_age(p.get('heartbeat_age_s'))} ago</td><td>lease {lease}</td>"
                    f"<td>GPU {gpu_text}</td><td>host {_size(mem.get('host_memory_bytes'))}</td>"
                    f"<td>ckpt disk free {_size(disk)}</td></tr>")  # fmt: skip
    for g in data.gateways:
        alive = g["age_s"] < 30
        rows.append(f"<tr><td>gateway <b>{escape(g['name'])}</b></td><td>{_badge(alive, 'up' if alive else 'silent')}"
                    f"</td><td>reported {_age(g['age_s'])} ago</td><td>v{escape(str(g.get('version', '')))}</td>"
                    "<td></td><td></td><td></td></tr>")  # fmt: skip
    r = data.redis
    if r.get("ok"):
        rows.append(f"<tr><td><b>Redis</b></td><td>{_badge(True, 'up')}</td><td>ping {r['ping_ms']:.1f} ms</td>"
                    f"<td>memory {_size(r.get('used_memory'))}</td><td></td><td></td><td></td></tr>")  # fmt: skip
    else:
        rows.append(f"<tr><td><b>Redis</b></td><td>{_badge(False, 'down')}</td><td colspan=5>"
                    f"{escape(str(r.get('error', '')))}</td></tr>")  # fmt: skip
    db = data.database
    rows.append(f"<tr><td><b>Database</b></td><td>{_badge(bool(db.get('ok')), 'up' if db.get('ok') else 'down')}</td>"
                f"<td colspan=5>{escape(str(db.get('error', '')))}</td></tr>")  # fmt: skip
    return '<table class="table table-sm table-vcenter mb-0 health">' + "".join(rows) + "</table>"


def _tenant_table(data: DashboardData) -> str:
    usage = {t: (k, s, c) for t, k, s, c in data.usage}
    names = sorted(set(usage) | set(data.shaped.tenant_totals))
    if not names:
        return '<p class="text-muted">no tenant activity in this range</p>'
    rows = []
    for name in names:
        t = data.shaped.tenant_totals.get(name, {})
        tokens, seconds, records = usage.get(name, (0, 0.0, 0))
        failed = int(t.get("failed", 0))
        rows.append(f"<tr><td>{escape(name)}</td><td>{int(t.get('ok', 0)):,}</td>"
                    f"<td class=\"{'text-red fw-bold' if failed else ''}\">{failed:,}</td><td>{tokens:,}</td>"
                    f"<td>{seconds:.1f} s</td><td>{seconds_label(t.get('wait p50', 0.0))}</td>"
                    f"<td>{seconds_label(t.get('wait p99', 0.0))}</td></tr>")  # fmt: skip
    return ('<table class="table table-sm mb-0"><tr><th>tenant</th><th>requests ok</th><th>failed</th>'
            "<th>tokens (usage)</th><th>GPU time (usage)</th><th>queue wait p50</th><th>p99</th></tr>"
            + "".join(rows) + "</table>")  # fmt: skip


def _adapter_table(data: DashboardData) -> str:
    if not data.adapters:
        return ""
    rows = "".join(
        f'<tr><td><a href="dashboard/adapter/{escape(a.model_id, quote=True)}">{escape(a.label)}</a></td>'
        f"<td>{escape(a.status)}</td><td>{a.fb_steps}</td><td>{a.optim_steps}</td>"
        f"<td>{'-' if a.applied_seq_id is None else a.applied_seq_id}</td>"
        f"<td>{'-' if a.last_loss is None else f'{a.last_loss:.4g}'}</td>"
        f'<td><a href="dashboard/adapter/{escape(a.model_id, quote=True)}/trace.json">trace</a></td></tr>'
        for a in data.adapters
    )
    return ('<table class="table table-sm mb-0 mt-2"><tr><th>adapter</th><th>status</th><th>fwd_bwd</th>'
            "<th>optim steps</th><th>applied seq_id</th><th>last loss:sum</th><th></th></tr>" + rows + "</table>")  # fmt: skip


def panels(data: DashboardData) -> list[dict[str, Any]]:
    s = data.shaped
    t0, t1 = s.start, s.end
    errors = {k: v for k, v in s.status.items() if s.status_totals.get(k)}
    totals = ", ".join(f"{k}: {n:,}" for k, n in s.status_totals.items())
    lat = ", ".join(f"{k} {seconds_label(v)}" for k, v in s.latency_totals.items() if v is not None)
    adapter_loss = {a.label: a.loss for a in data.adapters if a.loss}
    adapter_links = {a.label: f"dashboard/adapter/{a.model_id}" for a in data.adapters}
    adapter_notes = {a.label: f"{a.optim_steps} optim steps in range" for a in data.adapters}
    pipes = data.pipelines
    pipeline_loss = {f"{p.label} [{p.state}]": [(float(x), y) for x, y in p.train_losses] for p in pipes}
    return [
        {"key": "errors", "title": "Errors and rejections (per second)",
         "svg": charts.time_lines(errors, start=t0, end=t1, y_unit="per s") if errors else
         '<p class="text-success mb-1">none in this range</p>',
         "note": f"gateways' responses by class and the pools' failed futures; totals: {totals}"},
        {"key": "latency", "title": "Queue wait and compute per request (p50 / p99)",
         "svg": charts.time_lines(s.latency, start=t0, end=t1, y_unit="seconds", seconds=True),
         "note": f"queue wait: arrival to engine start; compute: the engine work that answered it. Whole range: {lat}"},
        {"key": "tenants", "title": "Tenants: requests, usage and queue wait in this range",
         "svg": _tenant_table(data), "wide": True},
        {"key": "tokens", "title": "Training tokens/s per tenant",
         "svg": charts.small_multiples(s.tokens, start=t0, end=t1, y_unit="tokens/s"),
         "note": f"forward and forward_backward tokens of answered requests, {s.bucket_s} s buckets"},
        {"key": "queued", "title": "Queued requests per tenant",
         "svg": charts.small_multiples(s.queued, start=t0, end=t1, y_unit="requests"),
         "note": "the largest queue seen in each bucket; now: " +
                 (", ".join(f"{t} {n:.0f}" for t, n in data.queue) or "empty")},
        {"key": "adapters", "title": "Adapters: loss and progress",
         "svg": charts.small_multiples(adapter_loss, start=t0, end=t1, y_unit="loss:sum", note=adapter_notes,
                                       links=adapter_links, own_x=True, x_label=lambda x: f"seq {x:.0f}")
                + _adapter_table(data),
         "note": "forward_backward loss:sum by seq_id, the steps answered in this range; click an adapter for its "
                 "requests and trace",
         "wide": True},
        {"key": "pipelines", "title": "Pipelines: progress and training loss",
         "svg": charts.bars([(f"{p.label} [{p.state}]", float(p.step)) for p in pipes],
                            of=[float(p.total) for p in pipes]) +
                charts.small_multiples(_by_step(pipeline_loss), start=0.0,
                                       end=float(max((p.total for p in pipes), default=1)), y_unit="loss",
                                       x_label=lambda x: f"step {x:.0f}"),
         "note": "queued and running ones, and those that ended in this range; loss over steps (x: step)"},
        {"key": "gateway", "title": "Gateway latency of short calls (p50 / p99)",
         "svg": charts.time_lines({f"gateway {k}": v for k, v in s.gateway_latency.items()}, start=t0, end=t1,
                                  y_unit="seconds", seconds=True),
         "note": "arrival to end of response; long-polls for results left out"},
        {"key": "slots", "title": "GPU slots in use per pool",
         "svg": charts.bars([(p, used) for p, used, _ in data.slots], of=[total for _, _, total in data.slots])},
        {"key": "tiers", "title": "Adapters per tier (GPU slot, host memory, disk)", "svg": charts.bars(data.tiers),
         "note": "swaps move adapters between these tiers"},
        {"key": "plans", "title": "Plans of this gateway's pool (since its Redis started)",
         "svg": charts.bars(data.plans), "note": "adapters per step > 1: tenants' steps share batches"},
        {"key": "layouts", "title": "Plan choices: forward_backward steps by layout", "svg": charts.bars(data.layouts),
         "note": "mixed: several adapters in one batch (the cost model's choice); since each pool started"},
        {"key": "swaps", "title": "Swaps between tiers", "svg": charts.bars(data.swaps),
         "note": "adapter moves since each pool started"},
    ]  # fmt: skip


def _by_step(series: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
    return {k: v for k, v in series.items() if v}
