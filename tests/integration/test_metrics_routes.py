"""The gateway's /metrics and /metrics/pools on real Redis (no pool): requests counted per route template (a made-up
id and a made-up path add no series), status codes (a body-limit 413 too), the metrics token, every pool's
published metrics merged (served only when opened, without a token), the pool's own metrics server behind the
same token, and the gateway's SQL statements counted."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.pool.metrics import PoolMetrics
from loraplex.protocol import BatchPlan, Outcome, Step, StepKind
from loraplex.protocol.results import ForwardBackwardResult
from loraplex.queue import published_metrics
from loraplex.runtime.metrics_server import MetricsServer
from loraplex.settings import Settings
from tests.helpers.policy import FB, req
from tests.integration.conftest import gateway_app

FB_ROUTE = "/v1/adapters/{model_id}/forward_backward"
TOKEN = "metrics-secret"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _count(samples, route: str, method: str, status: int) -> float:
    labels = tuple(sorted({"route": route, "method": method, "status": str(status)}.items()))
    return samples.get(("loraplex_gateway_requests_total", labels), 0.0)


def test_requests_are_counted_per_route_template_and_status(tmp_path, redis_url) -> None:
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"m-{tmp_path.name}", max_body_bytes=4096,
                        metrics_token=TOKEN)  # fmt: skip
    with gateway_app(settings) as gw:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        key = {"X-API-Key": gw.keys["alice"]}
        before = _samples(gw.client.get("/metrics", headers=auth).text)
        assert gw.client.get("/metrics").status_code == 401
        assert gw.client.get("/metrics/pools", headers={"Authorization": "Bearer wrong"}).status_code == 401
        body = {"data": [{"model_input": [1, 2], "loss_fn_inputs": {}}], "loss_fn": "cross_entropy", "seq_id": 1}
        for made_up in ("nope-1", "nope-2", "nope-3"):
            assert gw.client.post(f"/v1/adapters/{made_up}/forward_backward", json=body, headers=key).status_code == 404
        assert gw.client.get("/no/such/path", headers=key).status_code == 404
        big = b"x" * 8192
        too_big = gw.client.post("/v1/adapters/nope/forward_backward", content=big, headers=key)
        assert too_big.status_code == 413
        response = gw.client.get("/metrics", headers=auth)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        after = _samples(response.text)

    def delta(route: str, method: str, status: int) -> float:
        return _count(after, route, method, status) - _count(before, route, method, status)

    assert delta(FB_ROUTE, "POST", 404) == 3  # three ids, one series
    assert delta(FB_ROUTE, "POST", 413) == 1  # refused by the body limit before routing, still under its route
    assert delta("unmatched", "GET", 404) == 1
    assert delta("/metrics", "GET", 401) == 1 and delta("/metrics/pools", "GET", 401) == 1
    assert not any("nope" in str(labels) or "/no/such" in str(labels) for _, labels in after)
    latency = ("loraplex_gateway_request_seconds_count", (("method", "POST"), ("route", FB_ROUTE)))
    assert after[latency] - before.get(latency, 0.0) == 4


def test_the_gateways_sql_statements_are_counted_per_verb(tmp_path, redis_url) -> None:
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"s-{tmp_path.name}")
    with gateway_app(settings) as gw:
        def selects() -> float:
            samples = _samples(gw.client.get("/metrics").text)
            return samples.get(("loraplex_gateway_sql_statements_total", (("verb", "select"),)), 0.0)

        before = selects()
        key = {"X-API-Key": gw.keys["alice"]}
        assert gw.client.get("/v1/adapters/nope/checkpoints", headers=key).status_code == 404  # reads the adapter row
        assert selects() > before


def _pool_with_tokens(pool: str, tenant: str, tokens: int) -> PoolMetrics:
    metrics = PoolMetrics(pool, slots=2)
    r = req("a", 1, FB, tokens=tokens, tenant=tenant)
    metrics.executed(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (r,)),)), [Outcome(r.request_id, result=ForwardBackwardResult())], 0.0)
    return metrics


def test_metrics_pools_merges_every_pools_published_metrics(tmp_path, redis_client, redis_url) -> None:
    one, two = f"m1-{tmp_path.name}", f"m2-{tmp_path.name}"
    for pool, tokens in ((one, 5), (two, 9)):
        published_metrics.publish(redis_client, pool, _pool_with_tokens(pool, "tenant-x", tokens).exposition(), 30)
    with gateway_app(Settings(home=tmp_path, redis_url=redis_url, pool=one, metrics_open=True)) as gw:
        response = gw.client.get("/metrics/pools")  # no token set, opened by the operator
        assert response.status_code == 200
        samples = _samples(response.text)
        own = _samples(gw.client.get("/metrics").text)
    for pool, tokens in ((one, 5), (two, 9)):
        labels = tuple(sorted({"pool": pool, "tenant": "tenant-x", "kind": "forward_backward"}.items()))
        assert samples[("loraplex_pool_tokens_total", labels)] == tokens
    assert not any(name.startswith("loraplex_pool_") for name, _ in own)  # the gateway's own: no pool series
    # each tenant id named, for dashboards to join on `tenant` (the gateway's own /metrics names no tenant)
    for name, tenant_id in gw.tenant_ids.items():
        assert samples[("loraplex_tenant_info", (("name", name), ("tenant", tenant_id)))] == 1
    assert not any(name == "loraplex_tenant_info" for name, _ in own)


def test_the_pools_metrics_server_takes_the_same_token() -> None:
    metrics = _pool_with_tokens("served", "tenant-y", 3)
    server = MetricsServer("127.0.0.1", 0, metrics.exposition, token=TOKEN).start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert httpx.get(url).status_code == 401
        response = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200
        labels = tuple(sorted({"pool": "served", "tenant": "tenant-y", "kind": "forward_backward"}.items()))
        assert _samples(response.text)[("loraplex_pool_tokens_total", labels)] == 3
        assert httpx.get(f"http://127.0.0.1:{server.port}/other").status_code == 404
    finally:
        server.close()
