"""The dashboard's data shaping, pure: latency histograms that merge and their percentiles, bucket sizes per range,
the timeline's entries cut into per-bucket series (rates, percentiles, per-tenant tokens, the adapters' loss), the
alerts and since when, the charts' toggling legend and small multiples, and the pool's timeline accumulator."""

from __future__ import annotations

import random

import pytest

from loraplex.admin import charts
from loraplex.admin.dashboard_shaping import alerts, bucket_for, shape
from loraplex.pool.timeline import PoolTimeline
from loraplex.queue import latency_histogram as lh
from loraplex.queue.request_traces import TraceRecord
from loraplex.queue.timeline import GATEWAY, POOL, TimelineEntry


def test_histogram_percentiles_are_within_one_bucket_of_the_exact_ones_and_merge() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(-3, 1.2) for _ in range(5000)]
    halves: list[lh.Histogram] = [{}, {}]
    for i, v in enumerate(values):
        lh.observe(halves[i % 2], v)
    merged = lh.merge([{str(k): n for k, n in halves[0].items()}, halves[1]])  # the JSON form merges too
    assert lh.count(merged) == 5000
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[int(q * len(values)) - 1]
        got = lh.percentile(merged, q)
        assert got is not None and exact / lh.GROWTH <= got <= exact * lh.GROWTH, (q, exact, got)
    assert lh.percentile({}, 0.5) is None
    assert lh.bucket_of(0.0) == 0 and lh.bucket_of(1e9) == lh.BUCKETS - 1


def test_short_ranges_get_buckets_finer_than_30_s() -> None:
    assert bucket_for(300) == 2 and bucket_for(900) <= 10 and bucket_for(3600) <= 30
    assert all(r / bucket_for(r) <= 150 for r in (300, 900, 3600, 6 * 3600))


def _pool_entry(at: float, tenant: str, ok: int, failed: int, tokens: int, loss: float, wait_s: float) -> TimelineEntry:
    hist: lh.Histogram = {}
    for _ in range(ok + failed):
        lh.observe(hist, wait_s)
    data = {"requests": {tenant: [ok, failed]}, "tokens": {tenant: tokens}, "wait": hist, "compute": hist,
            "wait_by_tenant": {tenant: hist}, "adapters": {"m" + tenant: [tenant, loss, ok, 1, [[int(at), loss]]]},
            "queued": {tenant: 3}, "host_memory_bytes": 1e9}  # fmt: skip
    return TimelineEntry(f"{int(at * 1000)}-0", at, POOL, "pool-a", data)


def test_a_three_second_job_shows_in_its_buckets_with_names_rates_and_loss() -> None:
    now = 10_000.0
    entries = [_pool_entry(now - 5, "t1", 40, 0, 4000, 2.5, 0.01), _pool_entry(now - 3, "t1", 40, 2, 4000, 1.5, 0.2),
               _pool_entry(now - 3, "t2", 10, 0, 100, 9.0, 0.001),
               TimelineEntry("x", now - 4, GATEWAY, "gw", {"status": {"2xx": 90, "5xx": 4, "429": 2}})]  # fmt: skip
    s = shape(entries, now, 300, {"t1": "alice", "t2": "bob"})
    assert s.bucket_s == 2
    assert set(s.tokens) == {"alice", "bob"}
    assert sum(v for _, v in s.tokens["alice"]) * s.bucket_s == pytest.approx(8000)
    assert sum(v > 0 for _, v in s.tokens["alice"]) == 2  # two buckets, not one stub
    assert s.status_totals == {"4xx": 0, "429": 2, "5xx": 4, "failed futures": 2}
    assert now - 6 <= s.first_seen["5xx"] <= now - 4
    assert s.tenant_totals["alice"]["ok"] == 80 and s.tenant_totals["alice"]["failed"] == 2
    assert s.tenant_totals["alice"]["wait p99"] > s.tenant_totals["bob"]["wait p99"]
    assert s.loss["mt1"] == [(now - 5, 2.5), (now - 3, 1.5)]  # by seq_id (here: the entry's second)
    assert s.adapter_steps["mt1"] == ("t1", 80, 2)
    assert s.queued["alice"] and s.memory["pool-a"]["host_memory_bytes"] == 1e9
    p99 = dict(s.latency["queue wait p99"])
    assert max(p99.values()) == pytest.approx(0.2, rel=0.25)
    found = alerts(s, [{"name": "pool-b", "ok": False, "reason": "pool pool-b paused: no heartbeat for 40 s",
                        "heartbeat_age_s": 40.0}], {"gw": {"at": now - 100}}, True, now)  # fmt: skip
    texts = [a.text for a in found]
    assert texts[0].startswith("pool pool-b paused") and found[0].since == pytest.approx(now - 40)
    assert (
        any("silent" in t for t in texts)
        and any("5xx" in t for t in texts)
        and any("failed futures" in t for t in texts)
    )
    assert alerts(shape([], now, 300), [{"name": "a", "ok": True}], {}, True, now) == []


def test_time_lines_draw_a_toggling_legend_and_points_and_small_multiples_one_chart_each() -> None:
    svg = charts.time_lines({"a<b": [(1.0, 2.0), (2.0, 3.0)], "c": [(1.5, 1.0)]}, start=0, end=3, y_unit="x")
    assert svg.count('class="legend-item"') == 2 and 'data-series="a&lt;b"' in svg and "<circle" in svg
    grid = charts.small_multiples({"t1": [(1.0, 1.0)], "t2": [(1.0, 2.0)], "none": []}, start=0, end=2, y_unit="x",
                                  links={"t1": "dashboard/adapter/m1"})  # fmt: skip
    assert grid.count('class="multiple"') == 2 and 'href="dashboard/adapter/m1"' in grid
    assert "no data" in charts.time_lines({}, start=0, end=1, y_unit="x")
    columns = charts.stacked_columns([("r1", [("queue wait", 0.1), ("compute", 0.3)])], y_unit="s")
    assert columns.count('class="bar"') == 2


def _record(tenant: str, kind: str, ok: bool = True, loss: float | None = None) -> TraceRecord:
    return TraceRecord("r", tenant, "m-" + tenant, 1, kind, 10, ok, "p", 1.0, 1.1, 1.3, 1.5, 1.6, loss)


def test_the_pool_timeline_counts_answered_requests_and_stays_quiet_when_idle() -> None:
    timeline = PoolTimeline(gauges=lambda: {"host_memory_bytes": 5.0})
    first = timeline.take()
    assert first is not None and first["host_memory_bytes"] == 5.0  # the first round always reports
    assert timeline.take() is None  # idle: nothing until IDLE_EVERY_S
    timeline.answered([_record("t", "forward_backward", loss=2.0), _record("t", "optim_step"),
                       _record("t", "forward_backward", ok=False), _record("u", "sample")])  # fmt: skip
    entry = timeline.take({"t": 2})
    assert entry is not None
    assert entry["requests"] == {"t": [2, 1], "u": [1, 0]} and entry["tokens"] == {"t": 10}
    assert entry["adapters"]["m-t"] == ["t", 2.0, 1, 1, [[1, 2.0]]] and entry["queued"] == {"t": 2}
    assert lh.count(entry["wait"]) == 4 and lh.percentile(entry["wait"], 0.5) == pytest.approx(0.3, rel=0.13)
