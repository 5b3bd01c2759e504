"""Sampling through the whole service on a pool of 2 ranks (the pool process spawns rank 1; gloo on CPU): Tinker's
get_server_capabilities says the base model is sampleable, a tenant trains, saves weights for sampling and samples
them (seeded, several samples, mixed with base-model requests, a stop string) while another adapter trains beside
the samples; the same seeded requests give the same tokens again. And what the gateway says for a pool that cannot
sample: vLLM beside several ranks, or no sampler."""

from __future__ import annotations

import pytest

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.models import PoolState
from loraplex.storage.repositories import PoolRepository, TenantRepository, unit_of_work
from tests.integration.conftest import gateway_app

pytestmark = [pytest.mark.timeout(180)]


def _data(shift: int) -> list[Datum]:
    return [Datum.for_next_token([(7 * i + j + shift) % 200 + 10 for j in range(6 + 5 * i)]) for i in range(4)]


def _sampleable(client, key: str) -> bool:
    caps = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key})
    assert caps.status_code == 200, caps.text
    return bool(caps.json()["supported_models"][0]["sampleable"])


def test_a_two_rank_pool_samples_through_the_service(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_WORLD_SIZE", "2")  # the stack's children inherit the environment
    settings = Settings(home=tmp_path, slots=4, max_rank=8, world_size=2)
    stack = Stack(settings, api_port=free_port()).start()
    try:
        with unit_of_work(session_factory(make_db_engine(settings.resolved_database_url))) as session:
            key = TenantRepository(session).create_tenant("t")[1]
        import httpx

        with httpx.Client(base_url=stack.base_url, timeout=30) as http:
            assert _sampleable(http, key)
        service = ServiceClient(stack.base_url, key)
        trainer = service.create_lora_training_client(rank=4, seed=3)
        other = service.create_lora_training_client(rank=8, seed=4)
        for i in range(3):
            trainer.forward_backward(_data(i))
            trainer.optim_step(AdamParams(learning_rate=5e-2)).result()
        sampler = trainer.save_weights_and_get_sampling_client("w1")
        base = service.create_sampling_client()
        asks = [
            (sampler, dict(prompt=[5, 6, 7, 8], num_samples=3, max_tokens=24, temperature=1.0, seed=11, stop=[])),
            (base, dict(prompt=[40, 41], num_samples=2, max_tokens=16, temperature=0.7, seed=3, stop=[])),
            (sampler, dict(prompt=[9, 9, 9], max_tokens=12, temperature=0.0, stop=[])),
            (sampler, dict(prompt=[70, 71, 72, 73, 74], max_tokens=20, temperature=1.0, seed=5, stop=["zz"])),
        ]
        rounds = []
        for _ in range(2):
            futures = [client.sample(**ask) for client, ask in asks]
            fb = other.forward_backward(_data(9))  # training beside the samples, between their slices
            other.optim_step(AdamParams(learning_rate=1e-2))
            results = [f.result(timeout=120) for f in futures]
            assert fb.result(timeout=120)["metrics"]["loss:sum"] > 0
            rounds.append([[s["tokens"] for s in r["sequences"]] for r in results])
        first, again = rounds
        assert first == again  # seeded and greedy requests: the same tokens whichever rank decodes them
        assert [len(r) for r in first] == [3, 2, 1, 1]
        assert len({tuple(t) for t in first[0]}) == 3  # each sample draws its own tokens
        assert all(len(t) == 24 for t in first[0]) and len(first[2][0]) == 12
    finally:
        stack.stop()


@pytest.mark.parametrize(("sampler", "world", "expected"), [("native", 2, True), ("vllm", 2, False), ("vllm", 1, True),
                                                            ("none", 1, False)])  # fmt: skip
def test_capabilities_follow_the_sampler_and_the_pools_world_size(
    tmp_path, redis_url: str, sampler: str, world: int, expected: bool
) -> None:
    settings = Settings(home=tmp_path, redis_url=redis_url, pool=f"caps-{tmp_path.name}", sampler=sampler)
    with gateway_app(settings) as gw:
        with unit_of_work(gw.services.sessions) as session:  # the pool's heartbeat says its world size
            PoolRepository(session).heartbeat(settings.pool, settings.base_model, world, 4, restarted=True,
                                              state=PoolState.READY)  # fmt: skip
        assert _sampleable(gw.client, gw.keys["alice"]) is expected
