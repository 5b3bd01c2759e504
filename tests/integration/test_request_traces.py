"""Request traces and the dashboard's data through the gateway on real Redis and SQLite (no pool: the traces are
written as the dispatcher writes them, queue/request_traces.write): a tenant reads its own adapter's trace and numbers
and gets a 404 for another tenant's, as for a missing one; what is queued counts as in flight; the trace is valid
trace-event JSON; the gateway's responses reach the fleet timeline and the dashboard's data (its pool that never beat
is an alert), and /metrics says the pool is down."""

from __future__ import annotations

import time

from loraplex.admin.dashboard_data import TimelineCache, read_dashboard
from loraplex.api.timeline import TALLY
from loraplex.queue import request_traces, timeline
from loraplex.queue.request_traces import TraceRecord


def _record(tenant_id: str, model_id: str, seq: int, at: float) -> TraceRecord:
    return TraceRecord(f"req-{model_id}-{seq}", tenant_id, model_id, seq, "forward_backward", 64, True, "p",
                       at, at + 0.01, at + 0.05, at + 0.25, at + 0.3, 3.5 - seq * 0.1)  # fmt: skip


def test_a_tenant_reads_its_own_trace_and_stats_and_never_another_tenants(gateway) -> None:
    client, services = gateway.client, gateway.services
    alice, bob = {"X-API-Key": gateway.keys["alice"]}, {"X-API-Key": gateway.keys["bob"]}
    model_id = client.post("/v1/adapters", json={"rank": 4}, headers=alice).json()["model_id"]
    now = time.time()
    request_traces.write(
        services.redis, [_record(gateway.tenant_ids["alice"], model_id, s, now + s) for s in range(1, 4)]
    )
    body = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
    assert client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=alice).status_code == 202

    r = client.get(f"/v1/adapters/{model_id}/trace", headers=alice)
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    events = r.json()["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "request"]
    assert [s["name"] for s in spans] == [f"forward_backward #{s}" for s in (1, 2, 3)]
    assert sum(e["cat"] == "stage" for e in events if e["ph"] == "X") == 12
    assert any(e["ph"] == "M" and e["args"]["name"] == f"alice/{model_id}" for e in events)
    stats = client.get(f"/v1/adapters/{model_id}/stats", headers=alice).json()
    assert (
        stats["requests"] == 3 and stats["in_flight_requests"] == 2
    )  # its create and the step: no pool here and stats["in_flight_samples"] == 0
    assert 0 < stats["utilization"] < 1 and stats["tokens_per_s"] > 0

    for path in (f"/v1/adapters/{model_id}/trace", f"/v1/adapters/{model_id}/stats", "/v1/adapters/nope/trace",
                 "/v1/sessions/nope/stats"):  # fmt: skip
        denied = client.get(path, headers=bob)
        assert denied.status_code == 404, path
        assert model_id not in denied.text or "not found" in denied.json()["detail"]
    assert client.get(f"/v1/adapters/{model_id}/trace").status_code == 401
    assert client.get(f"/v1/adapters/{model_id}/trace?since=-1", headers=alice).status_code in (400, 422)
    # a record naming another tenant under alice's adapter key is never shown to alice
    request_traces.write(services.redis, [_record(gateway.tenant_ids["bob"], model_id, 9, now)])
    assert client.get(f"/v1/adapters/{model_id}/stats", headers=alice).json()["requests"] == 3


def test_the_gateways_responses_reach_the_dashboard_and_a_silent_pool_is_an_alert(gateway) -> None:
    client, services = gateway.client, gateway.services
    TALLY.take(force=True)  # what earlier tests of this process counted
    for _ in range(3):
        assert client.get("/v1/adapters", headers={"X-API-Key": "tml-wrong"}).status_code == 401
    entry = TALLY.take()
    assert entry is not None and entry["status"].get("4xx", 0) >= 3
    timeline.add(services.redis, timeline.GATEWAY, "gw-test", {**entry, "about": {"version": "t"}})
    data = read_dashboard(services, 300, cache=TimelineCache())
    assert data.shaped.status_totals["4xx"] >= 3
    assert any(g["name"] == "gw-test" for g in data.gateways)
    assert data.redis["ok"] and data.database["ok"]
    texts = [a.text for a in data.alerts]
    assert any("never sent a heartbeat" in t for t in texts) and any("client errors (4xx)" in t for t in texts)
    metrics = client.get("/metrics").text
    assert f'loraplex_gateway_pool_up{{pool="{services.settings.pool}"}} 0.0' in metrics
