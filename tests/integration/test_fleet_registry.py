"""The fleet's registry on a real redis-server: a pool's registration lives as long as its lease would (published
every third of the TTL, gone when not renewed, withdrawn on a clean stop), and a gateway (real SQLite, the app under
TestClient) serves every base model a live pool registered: Tinker's capabilities, /v1/models, create_model for each,
a 400 naming them for any other."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import select

from loraplex import service
from loraplex.pool.registration import RegistrationKeeper
from loraplex.protocol import OptimStepPayload
from loraplex.queue import pool_registry
from loraplex.queue.pool_registry import PoolRegistration
from loraplex.service import TenantRef, write_session
from loraplex.service.schemas import (
    CreateAdapterRequest,
    CreateSamplerRequest,
    ForwardBackwardRequest,
    SampleRequest,
    SaveCheckpointRequest,
)
from loraplex.settings import DEFAULT_TARGET_MODULES, Settings
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.models import Adapter
from tests.helpers.checkpoint_rows import saved_checkpoint
from tests.helpers.queued import queued
from tests.helpers.services.redis import redis_server
from tests.integration.conftest import Gateway, gateway_app


@pytest.fixture(scope="module")
def fleet_redis_url() -> Iterator[str]:
    """A redis-server of this module's own: registrations are fleet-wide, so no other test's pools may show up."""
    with redis_server() as url:
        yield url


@pytest.fixture()
def client(fleet_redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(fleet_redis_url)
    r.flushdb()
    yield r
    r.close()


def registration(name: str, base_model: str, **fields) -> PoolRegistration:
    return PoolRegistration(name=name, base_model=base_model, slots=4, max_rank=16,
                            target_modules=DEFAULT_TARGET_MODULES, state="ready", **fields)  # fmt: skip


def test_a_registration_is_live_until_its_ttl_and_withdrawn_at_once(client: redis.Redis) -> None:
    pool_registry.publish(client, registration("a", "tiny"), ttl_s=0.3)
    pool_registry.publish(client, registration("b", "tiny-moe"), ttl_s=30)
    assert [p.name for p in pool_registry.live_pools(client)] == ["a", "b"]
    pool_registry.withdraw(client, "b")
    assert [p.name for p in pool_registry.live_pools(client)] == ["a"]
    time.sleep(0.4)
    assert pool_registry.live_pools(client) == []  # a not renewed: gone with its TTL


def test_the_keeper_renews_every_third_of_the_ttl_and_withdraws_on_a_clean_stop(client: redis.Redis) -> None:
    calls: list[float] = []

    def describe() -> PoolRegistration:
        calls.append(time.monotonic())
        return registration("kept", "tiny", queued_tokens=len(calls))

    keeper = RegistrationKeeper(client, describe, ttl_s=0.6).start()
    time.sleep(1.0)  # past the TTL: only renewals keep it
    live = pool_registry.live_pools(client)
    assert [p.name for p in live] == ["kept"] and live[0].queued_tokens >= 3, live
    keeper.close()
    assert pool_registry.live_pools(client) == []

    killed = RegistrationKeeper(client, describe, ttl_s=0.3).start()
    killed.close(withdraw=False)  # a deposed leader: its registration lapses by itself
    assert [p.name for p in pool_registry.live_pools(client)] == ["kept"]
    time.sleep(0.4)
    assert pool_registry.live_pools(client) == []


def test_the_queue_load_counts_every_tenants_requests_and_tokens(client: redis.Redis) -> None:
    from loraplex.queue import keys

    for tenant, n, tokens in (("t1", 2, 30), ("t2", 1, 12)):
        client.sadd(keys.pool_tenants("p"), tenant)
        for _ in range(n):
            client.xadd(keys.request_stream("p", tenant), {"x": "1"})
        client.hset(keys.queued_tokens("p"), tenant, tokens)
    assert pool_registry.queue_load(client, "p") == (3, 42)
    assert pool_registry.queue_load(client, "empty") == (0, 0)


@pytest.fixture()
def gw(tmp_path, fleet_redis_url: str, client: redis.Redis) -> Iterator[Gateway]:
    settings = Settings(home=tmp_path, redis_url=fleet_redis_url, pool="home", max_rank=16)
    with gateway_app(settings) as gateway:
        yield gateway


def _h(gw: Gateway, name: str = "alice") -> dict[str, str]:
    return {"X-API-Key": gw.keys[name]}


def _create_model(gw: Gateway, base_model: str, seq: int = 0) -> dict:
    session = gw.client.post("/api/v1/create_session", json={"tags": []}, headers=_h(gw)).json()["session_id"]
    body = {"session_id": session, "model_seq_id": seq, "base_model": base_model, "lora_config": {"rank": 4}}
    return gw.client.post("/api/v1/create_model", json=body, headers=_h(gw))


def test_the_gateway_serves_every_registered_base_model_and_names_them_for_any_other(
    gw: Gateway, client: redis.Redis
) -> None:
    caps = gw.client.get("/api/v1/get_server_capabilities", headers=_h(gw)).json()
    assert [m["model_name"] for m in caps["supported_models"]] == ["tiny"]  # no pool registered: the gateway's own
    assert _create_model(gw, "tiny-moe").status_code == 400

    pool_registry.publish(client, registration("p-tiny", "tiny"), ttl_s=30)
    pool_registry.publish(client, registration("p-moe", "tiny-moe", sampleable=False), ttl_s=30)
    gw.services.fleet_view.forget()
    caps = gw.client.get("/api/v1/get_server_capabilities", headers=_h(gw)).json()["supported_models"]
    assert [(m["model_name"], m["sampleable"]) for m in caps] == [("tiny", True), ("tiny-moe", False)]
    models = gw.client.get("/v1/models", headers={"Authorization": f"Bearer {gw.keys['alice']}"}).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "tiny-moe"]

    created = _create_model(gw, "tiny-moe")
    assert created.status_code == 200, created.text
    info = gw.client.post("/api/v1/get_info", json={"model_id": created.json()["model_id"]}, headers=_h(gw)).json()
    assert info["model_data"]["model_name"] == "tiny-moe"
    other = _create_model(gw, "Qwen/Qwen3-8B")
    assert other.status_code == 400
    assert other.json()["detail"] == "base_model 'Qwen/Qwen3-8B' is not served here; served: 'tiny', 'tiny-moe'"
    native = gw.client.post("/v1/adapters", json={"base_model": "tiny-moe", "rank": 4}, headers=_h(gw))
    assert native.status_code in (200, 202) and native.json()["model_id"], native.text
    sampler = gw.client.post("/v1/samplers", json={"base_model": "tiny-moe"}, headers=_h(gw))
    assert sampler.status_code in (200, 201) and sampler.json()["base_model"] == "tiny-moe", sampler.text

    pool_registry.withdraw(client, "p-moe")  # its only pool stopped: tiny-moe is no longer served
    gw.services.fleet_view.forget()
    gone = _create_model(gw, "tiny-moe", seq=1)
    assert gone.status_code == 400 and "served: 'tiny'" in gone.json()["detail"]


def test_adapters_spread_over_the_pools_of_their_model_and_every_request_follows_its_adapter(
    gw: Gateway, client: redis.Redis
) -> None:
    for name, base in (("p-a", "tiny"), ("p-b", "tiny"), ("p-moe", "tiny-moe")):
        pool_registry.publish(client, registration(name, base), ttl_s=30)
    gw.services.fleet_view.forget()
    services = gw.services
    alice, bob = (TenantRef(gw.tenant_ids[n], n) for n in ("alice", "bob"))

    def create(who: TenantRef, base_model: str) -> str:
        return service.create_adapter(services, who, CreateAdapterRequest(base_model=base_model, rank=4)).model_id

    tiny = [create(who, "tiny") for who in (alice, bob, alice, bob, alice, bob)]
    moe = create(alice, "tiny-moe")
    with services.sessions() as db:
        placed = {a.model_id: a.pool for a in db.scalars(select(Adapter))}
    assert [placed[m] for m in tiny] == ["p-a", "p-b"] * 3  # tenants' adapters spread over the pools of their model
    assert placed[moe] == "p-moe"

    def where(request_id: str) -> list[str]:
        return [p for p in ("home", "p-a", "p-b", "p-moe") if request_id in queued(services, p)]

    on_b = tiny[1]
    data = ForwardBackwardRequest(seq_id=1, data=[{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}])
    refs = [
        service.forward_backward(services, bob, on_b, 1, data.payload()),
        service.optim_step(services, bob, on_b, 2, OptimStepPayload(adam_params={"learning_rate": 1e-3})),
        service.save_weights_for_sampler(services, bob, on_b, SaveCheckpointRequest(seq_id=3, name="s")),
    ]
    assert [where(r.request_id) for r in refs] == [["p-b"]] * 3
    path = saved_checkpoint(services, bob.id, on_b, CheckpointKind.SAMPLER, "t")
    sampler = service.create_sampler(services, bob, CreateSamplerRequest(model_path=path))
    sample = service.sample(services, bob, sampler.sampler_id, SampleRequest(seq_id=0, prompt=[1, 2], max_tokens=2))
    assert where(sample.request_id) == ["p-b"]  # the adapter's pool: it holds the adapter's sampler copies
    base = service.create_sampler(services, alice, CreateSamplerRequest(base_model="tiny-moe"))
    sample = service.sample(services, alice, base.sampler_id, SampleRequest(seq_id=0, prompt=[1, 2], max_tokens=2))
    assert where(sample.request_id) == ["p-moe"]
    assert where(service.delete_adapter(services, bob, on_b).request_id) == ["p-b"]

    # Isolation holds across pools: another tenant's adapter is a 404 wherever it is placed.
    for model_id in (tiny[0], moe):
        assert gw.client.get(f"/v1/adapters/{model_id}", headers=_h(gw, "bob")).status_code == 404
        body = {"seq_id": 1, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
        fb = gw.client.post(f"/v1/adapters/{model_id}/forward_backward", json=body, headers=_h(gw, "bob"))
        assert fb.status_code == 404


def test_an_adapter_from_before_the_fleet_goes_to_the_gateways_own_pool(gw: Gateway, client: redis.Redis) -> None:
    alice = TenantRef(gw.tenant_ids["alice"], "alice")
    model_id = service.create_adapter(gw.services, alice, CreateAdapterRequest(rank=4)).model_id
    with write_session(gw.services) as db:
        db.get(Adapter, model_id).pool = None  # as migration 0010 leaves an older row
    ref = service.optim_step(gw.services, alice, model_id, 1, OptimStepPayload(adam_params={}))
    assert ref.request_id in queued(gw.services, "home")
