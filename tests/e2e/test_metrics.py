"""Prometheus metrics after real traffic on the embedded stack (tiny CPU model): two tenants train concurrently, one
samples, one sends a step for a made-up adapter; then the gateway's /metrics (requests per route template and status),
the pool's own /metrics (its port) and the gateway's /metrics/pools (the pool's numbers through Redis) are scraped and
their counts checked against what was sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import TenantRepository
from tests.helpers.stack import create_tenants

FB_ROUTE = "/v1/adapters/{model_id}/forward_backward"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def _eventually(read: Callable[[], Samples], check: Callable[[Samples], bool], timeout_s: float = 15.0) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = read()
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def _tenant_id(stack, key: str) -> str:
    with session_factory(make_db_engine(stack.settings.resolved_database_url))() as session:
        return TenantRepository(session).authenticate(key).id


def _batch(offset: int, sizes: list[int]) -> list[Datum]:
    return [Datum.for_next_token([(offset + 3 * i + j) % 150 + 10 for j in range(n + 1)]) for i, n in enumerate(sizes)]


def _train(client: ServiceClient, offset: int, batches: list[list[int]], sent: dict[int, int]) -> None:
    trainer = client.create_lora_training_client(rank=4, seed=offset)
    for sizes in batches:
        fb = trainer.forward_backward(_batch(offset, sizes))
        opt = trainer.optim_step(AdamParams(learning_rate=1e-2))
        fb.result()
        opt.result()
    sent[offset] = sum(sum(sizes) for sizes in batches)  # input tokens: each datum's model_input


def test_metrics_count_the_traffic_sent(stack) -> None:
    keys = create_tenants(stack, "metrics-a", "metrics-b")
    a, b = (ServiceClient(stack.base_url, keys[n]) for n in ("metrics-a", "metrics-b"))
    tenant_a, tenant_b = _tenant_id(stack, keys["metrics-a"]), _tenant_id(stack, keys["metrics-b"])
    gateway = f"{stack.base_url}/metrics"
    pool_port = stack.settings.pool_metrics_port
    pool = f"http://127.0.0.1:{pool_port}/metrics"
    before_gw, before_pool = _scrape(gateway), _scrape(pool)

    # Two tenants concurrently: 3 steps of 2 datums, and 2 steps of 1 datum.
    plans = {1: [[5, 7], [6, 6], [9, 4]], 2: [[11], [8]]}
    sent: dict[int, int] = {}
    threads = [threading.Thread(target=_train, args=(c, off, plans[off], sent)) for c, off in ((a, 1), (b, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(sent) == {1, 2}
    sampled = b.create_sampling_client().sample([11, 12, 13], num_samples=2, max_tokens=5, temperature=0.0,
                                                stop=[]).result()  # fmt: skip
    assert sum(len(s["tokens"]) for s in sampled["sequences"]) == 10
    body = {"data": [d.to_json() for d in _batch(0, [3])], "loss_fn": "cross_entropy", "seq_id": 1}
    missing = httpx.post(f"{stack.base_url}/v1/adapters/no-such-adapter/forward_backward", json=body,
                         headers={"X-API-Key": keys["metrics-a"]})  # fmt: skip
    assert missing.status_code == 404

    # The gateway: 5 forward_backward requests accepted (202), one 404 for the made-up id, under the route template.
    gw = _scrape(gateway)

    def route_delta(route: str, method: str, status: str) -> float:
        labels = {"route": route, "method": method, "status": status}
        return _value(gw, "loraplex_gateway_requests_total", **labels) - _value(
            before_gw, "loraplex_gateway_requests_total", **labels
        )

    assert route_delta(FB_ROUTE, "POST", "202") == 5
    assert route_delta(FB_ROUTE, "POST", "404") == 1
    assert route_delta("/v1/adapters/{model_id}/optim_step", "POST", "202") == 5
    assert not any("no-such-adapter" in str(labels) for _, labels in gw)
    latency = _total(gw, "loraplex_gateway_request_seconds_count", route=FB_ROUTE, method="POST")
    assert latency - _total(before_gw, "loraplex_gateway_request_seconds_count", route=FB_ROUTE, method="POST") == 6

    # The pool's own /metrics: per-tenant tokens equal what each tenant sent; requests, steps and sampled tokens.
    def pool_expected(s: Samples) -> dict[str, float]:
        fb, ok = {"kind": "forward_backward"}, {"result": "ok"}
        return {
            "tokens_a": _value(s, "loraplex_pool_tokens_total", pool="default", tenant=tenant_a, **fb),
            "tokens_b": _value(s, "loraplex_pool_tokens_total", pool="default", tenant=tenant_b, **fb),
            "fb_ok_a": _value(s, "loraplex_pool_requests_total", pool="default", tenant=tenant_a, **fb, **ok),
            "opt_ok_b": _value(
                s, "loraplex_pool_requests_total", pool="default", tenant=tenant_b, kind="optim_step", **ok
            ),
            "sampled_b": _value(s, "loraplex_pool_sampled_tokens_total", pool="default", tenant=tenant_b),
        }

    want = {"tokens_a": sent[1], "tokens_b": sent[2], "fb_ok_a": 3, "opt_ok_b": 2, "sampled_b": 10}
    own = _scrape(pool)
    assert pool_expected(own) == want  # counted before the results were visible: no waiting needed
    fb_steps = _total(own, "loraplex_pool_steps_total", kind="forward_backward") - _total(
        before_pool, "loraplex_pool_steps_total", kind="forward_backward"
    )
    layouts = _total(own, "loraplex_pool_fb_steps_total") - _total(before_pool, "loraplex_pool_fb_steps_total")
    assert 3 <= fb_steps <= 5 and layouts == fb_steps  # 5 requests, in at least 3 steps (tenant a's are in order)
    tokens_per_step = _total(own, "loraplex_pool_fb_step_tokens_sum") - _total(
        before_pool, "loraplex_pool_fb_step_tokens_sum"
    )
    assert tokens_per_step == sent[1] + sent[2]
    for phase in ("read", "plan", "forward_backward", "optim_step", "record", "publish"):
        assert _value(own, "loraplex_pool_seconds_total", pool="default", phase=phase) > 0, phase
    assert _value(own, "loraplex_pool_slots", pool="default") == 4
    # Wired to the engine (CUDA graphs only on a GPU: zero here, and present from the start).
    assert ("loraplex_pool_graph_captures_total", (("pool", "default"),)) in own
    assert _value(own, "loraplex_pool_graph_captures_total", pool="default") == 0
    assert _value(own, "loraplex_pool_graph_memory_bytes", pool="default") == 0
    assert ("loraplex_pool_gc_seconds_total", (("pool", "default"),)) in own  # the pool's GcClock (gcutil.py)
    for event in ("device_alloc", "device_free", "alloc_retry"):  # no CUDA allocator here: present, zero
        assert _value(own, "loraplex_pool_cuda_allocator_events_total", pool="default", event=event) == 0
    assert _value(own, "loraplex_pool_adapters", pool="default", tier="gpu") >= 2
    drained = _eventually(
        lambda: _scrape(pool),  # entries leave their stream when acked, just after the result
        lambda s: _value(s, "loraplex_pool_queued_requests", pool="default", tenant=tenant_a) == 0,
    )
    assert _value(drained, "loraplex_pool_queued_requests", pool="default", tenant=tenant_a) == 0

    # The same numbers through Redis, at the gateway's /metrics/pools (published every 0.5 s here).
    through_redis = _eventually(lambda: _scrape(f"{stack.base_url}/metrics/pools"),
                                lambda s: pool_expected(s) == want)  # fmt: skip
    assert pool_expected(through_redis) == want
