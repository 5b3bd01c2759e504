"""`/v1/healthz` and the futures route against the `pools` table: 503 naming the part while this gateway's pool has
never beaten, is loading its model, has stopped or has gone quiet; 200 once it beats READY; a pending future answers
queue_state paused_capacity with a reason while the pool is down, active when it is up."""

from __future__ import annotations

from datetime import timedelta

from loraplex.service.pool_health import PoolView
from loraplex.storage.models import Pool, PoolState
from loraplex.storage.repositories import PoolRepository, unit_of_work
from loraplex.storage.types import utcnow


def _beat(services, state: PoolState, age_s: float = 0.0) -> None:
    s = services.settings
    with unit_of_work(services.sessions) as session:
        PoolRepository(session).heartbeat(s.pool, s.base_model, 1, s.slots, state=state)
        if age_s:
            session.get(Pool, s.pool).heartbeat_at = utcnow() - timedelta(seconds=age_s)


def test_healthz_is_503_until_the_pool_is_ready_and_names_what_is_down(gateway) -> None:
    client, services = gateway.client, gateway.services
    pool = services.settings.pool

    never = client.get("/v1/healthz")
    assert never.status_code == 503
    body = never.json()
    assert body["status"] == "unavailable" and body["redis"] == {"ok": True} and body["database"] == {"ok": True}
    assert body["gateway"]["ok"] is True and "never sent a heartbeat" in body["down"][0]

    _beat(services, PoolState.LOADING)
    loading = client.get("/v1/healthz")
    assert loading.status_code == 503 and loading.json()["down"] == [f"pool {pool} paused: loading its base model"]
    (row,) = [p for p in loading.json()["pools"] if p["name"] == pool]
    assert row["state"] == "loading" and row["ok"] is False and row["heartbeat_age_s"] < 5

    _beat(services, PoolState.READY)
    ready = client.get("/v1/healthz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "ok" and ready.json()["down"] == []

    stale = services.settings.pool_stale_seconds + 25
    _beat(services, PoolState.READY, age_s=stale)
    dead = client.get("/v1/healthz")
    assert dead.status_code == 503 and f"no heartbeat for {stale:.0f} s" in dead.json()["down"][0]

    _beat(services, PoolState.STOPPED)
    assert client.get("/v1/healthz").json()["down"] == [f"pool {pool} paused: stopped"]


def test_a_pending_future_says_paused_capacity_while_the_pool_is_down(gateway) -> None:
    client, services = gateway.client, gateway.services
    services.pool_view = PoolView(ttl_s=0)  # no per-process caching in this test
    alice = {"X-API-Key": gateway.keys["alice"]}
    created = client.post("/v1/adapters", json={"rank": 4}, headers=alice).json()
    future = f"/v1/futures/{created['request_id']}?timeout=0"

    _beat(services, PoolState.READY, age_s=services.settings.pool_stale_seconds + 30)
    paused = client.get(future, headers=alice).json()
    assert paused["state"] == "queued" and paused["queue_state"] == "paused_capacity"
    assert "no heartbeat for" in paused["queue_state_reason"]

    _beat(services, PoolState.LOADING)
    assert "loading" in client.get(future, headers=alice).json()["queue_state_reason"]

    _beat(services, PoolState.READY)
    active = client.get(future, headers=alice).json()
    assert active["queue_state"] == "active" and active["queue_state_reason"] is None
