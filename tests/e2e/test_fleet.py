"""A fleet on one gateway: `loraplex serve --embedded`'s stack with three pools (two of `tiny`, one of `tiny-moe`),
each its own process under its own name, driven by the official Tinker SDK unchanged. Tenants of both base models
train at once and their losses fall; the gateway serves both models; sixteen new adapters spread over the two tiny pools
by the placement rule and each pool runs only its own adapters' steps; another tenant's adapter is a 404 on every route
and pool."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import redis
import tinker
from sqlalchemy import select
from tinker import types

from loraplex.launch.embedded import Stack
from loraplex.queue import pool_registry, stats
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.models import Adapter
from tests.helpers.sdk import train
from tests.helpers.stack import create_tenants

pytestmark = [pytest.mark.timeout(600)]

POOLS = {"default": "tiny", "default-2": "tiny", "default-3": "tiny-moe"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = Settings(home=tmp_path_factory.mktemp("fleet"), slots=2, max_rank=8)
    with Stack(settings, api_port=free_port(), pool_models=list(POOLS.values())) as running:
        yield running


@pytest.fixture(scope="module")
def keys(stack):
    return create_tenants(stack, "f-alice", "f-bob", "f-carol")


def batch(seed: int, n: int = 2, length: int = 10) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 250, size=length).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)}))  # fmt: skip
    return out


def test_tenants_of_two_base_models_train_at_once_spread_over_the_pools_and_stay_isolated(stack, keys) -> None:
    r = redis.Redis.from_url(stack.settings.redis_url)
    assert {p.name: p.base_model for p in pool_registry.live_pools(r)} == POOLS  # each process registered itself
    caps = httpx.get(f"{stack.base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": keys["f-alice"]})
    assert [m["model_name"] for m in caps.json()["supported_models"]] == ["tiny", "tiny-moe"]

    services = {name: tinker.ServiceClient(base_url=stack.base_url, api_key=key) for name, key in keys.items()}
    # Created one by one, as tenants arrive: sixteen tiny adapters of two tenants, two tiny-moe ones of two others.
    wanted = [("f-alice", "tiny"), ("f-bob", "tiny")] * 8 + [("f-carol", "tiny-moe"), ("f-alice", "tiny-moe")]
    clients = [services[who].create_lora_training_client(base_model=base, rank=4, seed=i).result()
               for i, (who, base) in enumerate(wanted)]  # fmt: skip
    ids = [t.model_id for t in clients]
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    with sessions() as db:
        placed = {a.model_id: a.pool for a in db.scalars(select(Adapter))}
    assert [placed[m] for m in ids] == ["default", "default-2"] * 8 + ["default-3"] * 2  # 8 on each tiny pool

    trainers = clients[:4] + clients[16:]  # two tiny adapters on each tiny pool, both tiny-moe ones
    before = {pool: stats.read(r, pool).plans for pool in POOLS}
    with ThreadPoolExecutor(len(trainers)) as threads:  # every tenant trains at once, both base models
        losses = list(threads.map(lambda job: train(job[1], batch(job[0]), 6), enumerate(trainers)))
    for curve in losses:
        assert curve[-1] < 0.8 * curve[0], losses
    assert all(stats.read(r, pool).plans > before[pool] for pool in POOLS)  # every pool ran its own adapters' steps

    # Isolation across pools: bob sees none of alice's or carol's adapters, on whichever pool they are placed.
    bob = {"X-API-Key": keys["f-bob"]}
    for model_id, (who, _) in zip(ids, wanted, strict=True):
        if who == "f-bob":
            continue
        assert httpx.post(f"{stack.base_url}/api/v1/get_info", json={"model_id": model_id}, headers=bob).status_code == 404
        assert httpx.get(f"{stack.base_url}/v1/adapters/{model_id}", headers=bob).status_code == 404
        body = {"seq_id": 99, "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}]}
        fb = httpx.post(f"{stack.base_url}/v1/adapters/{model_id}/forward_backward", json=body, headers=bob)
        assert fb.status_code == 404
    with pytest.raises(tinker.BadRequestError, match="served: 'tiny', 'tiny-moe'"):
        services["f-bob"].create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    for client in services.values():
        client.close("success").result()
