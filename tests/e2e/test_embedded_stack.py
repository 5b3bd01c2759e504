"""The embedded stack end to end: real redis-server child, SQLite with migrations, the gateway under uvicorn, the
dispatcher and one CPU worker rank, driven through the Python client."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.launch.embedded import Stack
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import AdapterRepository, TenantRepository
from tests.helpers.stack import create_tenants


@pytest.fixture(scope="module")
def keys(stack):
    return create_tenants(stack, "t-one", "t-two")


def _data(offset: int) -> list[Datum]:
    return [Datum.for_next_token([(offset + 7 * i + j) % 200 + 10 for j in range(12)]) for i in range(3)]


def _train(client: ServiceClient, offset: int, steps: int, out: dict) -> None:
    trainer = client.create_lora_training_client(rank=8, seed=offset)
    losses = []
    for _ in range(steps):
        fb = trainer.forward_backward(_data(offset))
        opt = trainer.optim_step(AdamParams(learning_rate=2e-2))
        result = fb.result()
        assert len(result["loss_fn_outputs"]) == 3
        assert len(result["loss_fn_outputs"][0]["logprobs"]) == 11
        losses.append(result["metrics"]["loss:sum"])
        opt.result()
    out[offset] = (trainer, losses)


def test_two_tenants_train_concurrently_and_stay_isolated(stack, keys):
    one, two = ServiceClient(stack.base_url, keys["t-one"]), ServiceClient(stack.base_url, keys["t-two"])
    results: dict = {}
    threads = [threading.Thread(target=_train, args=(c, off, 12, results)) for c, off in ((one, 1), (two, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (trainer_one, losses_one), (trainer_two, losses_two) = results[1], results[2]
    assert losses_one[-1] < 0.5 * losses_one[0] and losses_two[-1] < 0.5 * losses_two[0]
    assert [a["model_id"] for a in one.list_adapters()] == [trainer_one.model_id]
    assert [a["model_id"] for a in two.list_adapters()] == [trainer_two.model_id]
    # Tenant two cannot read or train tenant one's adapter.
    with pytest.raises(NotFoundError):
        two.training_client(trainer_one.model_id)
    with pytest.raises(NotFoundError):
        from loraplex.client import TrainingClient

        TrainingClient(two._transport, trainer_one.model_id).forward_backward(_data(1)).result(timeout=30)
    # The applied seq_id is recorded: 12 forward_backward + 12 optim_step after create (seq 0).
    with session_factory(make_db_engine(stack.settings.resolved_database_url))() as session:
        adapter = AdapterRepository(session, trainer_one_tenant(stack, keys["t-one"])).get(trainer_one.model_id)
        assert adapter.applied_seq_id == 24 and str(adapter.status) == "ready"


def trainer_one_tenant(stack: Stack, key: str) -> str:
    with session_factory(make_db_engine(stack.settings.resolved_database_url))() as session:
        return TenantRepository(session).authenticate(key).id


def test_bad_step_fails_alone_and_training_continues(stack, keys):
    client = ServiceClient(stack.base_url, keys["t-one"])
    trainer = client.create_lora_training_client(rank=4, seed=5)
    bad = trainer.forward_backward([Datum.for_next_token([1, 2, 10**7])])
    with pytest.raises(InvalidRequestError):
        bad.result()
    good = trainer.forward_backward(_data(3)).result()
    assert good["metrics"]["loss:sum"] > 0
    assert trainer.optim_step().result() is not None
    trainer.delete()
    with pytest.raises(NotFoundError):
        trainer.info()


def test_awaiting_a_training_step_takes_one_poll_for_both_results(stack, keys):
    """The client's poll for one future names its other unsettled futures (client/unsettled.py), and the gateway
    answers those already finished: the optim_step's result holds the forward_backward's, done in the same plan or
    the one before, so the step costs one GET, and both futures hold their own results."""
    client = ServiceClient(stack.base_url, keys["t-two"])
    trainer = client.create_lora_training_client(rank=4, seed=9)
    polls: list[str] = []
    client._transport._sync.event_hooks["request"].append(
        lambda request: polls.append(request.url.path) if request.url.path.startswith("/v1/futures/") else None
    )
    fb = trainer.forward_backward(_data(4))
    opt = trainer.optim_step(AdamParams(learning_rate=1e-3))
    optim = opt.result()
    forward_backward = fb.result()
    assert polls == [f"/v1/futures/{opt.request_id}"]
    assert len(forward_backward["loss_fn_outputs"]) == 3 and "loss:sum" in forward_backward["metrics"]
    assert "loss_fn_outputs" not in optim and optim == opt.result()
    trainer.delete()


def test_cli_tenant_create_prints_the_key_last(stack):
    env = dict(os.environ, LORAPLEX_HOME=str(stack.settings.home))
    out = subprocess.run(
        [sys.executable, "-m", "loraplex.launch.cli", "tenant", "create", "cli-tenant"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("tml-")
    assert ServiceClient(stack.base_url, key).list_adapters() == []


def test_cli_rotates_and_revokes_a_tenants_keys(stack):
    """`loraplex tenant rotate-key` prints a new key and revokes the older ones; `revoke-key` revokes one; an unknown
    tenant is a one-line error, no traceback. Revocation reaches the gateway within LORAPLEX_AUTH_CACHE_SECONDS."""
    import time

    from loraplex.errors import AuthenticationError

    env = dict(os.environ, LORAPLEX_HOME=str(stack.settings.home))

    def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "tenant", *args], env=env, capture_output=True,
                              text=True, check=check)  # fmt: skip

    old_key = cli("create", "cli-rotor").stdout.strip().splitlines()[-1]
    assert ServiceClient(stack.base_url, old_key).list_adapters() == []
    new_key = cli("rotate-key", "cli-rotor").stdout.strip().splitlines()[-1]
    assert new_key.startswith("tml-") and new_key != old_key
    keys_listed = cli("keys", "cli-rotor").stdout.strip().splitlines()
    assert len(keys_listed) == 2 and sum("revoked" in line for line in keys_listed) == 1
    time.sleep(stack.settings.auth_cache_seconds + 0.5)
    with pytest.raises(AuthenticationError):
        ServiceClient(stack.base_url, old_key).list_adapters()
    assert ServiceClient(stack.base_url, new_key).list_adapters() == []
    active = next(line.split()[0] for line in keys_listed if "active" in line)
    cli("revoke-key", "cli-rotor", active)
    time.sleep(stack.settings.auth_cache_seconds + 0.5)
    with pytest.raises(AuthenticationError):
        ServiceClient(stack.base_url, new_key).list_adapters()
    unknown = cli("rotate-key", "nobody-here", check=False)
    assert unknown.returncode == 2 and "nobody-here" in unknown.stderr and "Traceback" not in unknown.stderr


def test_cli_tenant_delete_refuses_live_adapters_then_deletes_them_through_the_queue(stack):
    """`loraplex tenant delete NAME` refuses (exit 2, one line) while the tenant has live adapters; `--force` revokes
    its keys, deletes its adapters through the queue (the pool answers each delete_adapter) and removes the tenant,
    its rows and its checkpoint files."""
    import time

    import redis

    from loraplex.errors import AuthenticationError
    from loraplex.queue import keys
    from loraplex.queue.producer import Claim
    from loraplex.queue.redis_text import text
    from loraplex.queue.results import ResultStore
    from loraplex.storage.models import Adapter

    env = dict(os.environ, LORAPLEX_HOME=str(stack.settings.home), LORAPLEX_REDIS_URL=stack.settings.redis_url)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "tenant", *args], env=env, capture_output=True,
                              text=True)  # fmt: skip

    key = cli("create", "cli-leaver").stdout.strip().splitlines()[-1]
    client = ServiceClient(stack.base_url, key)
    tc = client.create_lora_training_client(rank=4)
    tc.forward_backward([Datum.for_next_token([1, 2, 3, 4])]).result(timeout=60)
    tc.optim_step().result(timeout=60)
    tc.save_state("before-leaving").result(timeout=60)
    blobs = stack.settings.resolved_blob_root
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    with sessions() as session:
        tenant_id = TenantRepository(session).get_by_name("cli-leaver").id
    assert (blobs / tenant_id).is_dir()

    refused = cli("delete", "cli-leaver")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and "1 live adapter" in refused.stderr and "--force" in refused.stderr
    assert client.list_adapters()[0]["model_id"] == tc.model_id  # nothing changed

    done = cli("delete", "cli-leaver", "--force")
    assert done.returncode == 0, done.stderr
    assert "deleted, with 1 adapter" in done.stdout
    with sessions() as session:
        assert session.get(Adapter, tc.model_id) is None  # the row went with the tenant
        assert [t.name for t in TenantRepository(session).list() if t.name == "cli-leaver"] == []
    assert not (blobs / tenant_id).exists()
    time.sleep(stack.settings.auth_cache_seconds + 0.5)
    with pytest.raises(AuthenticationError):
        client.list_adapters()
    r = redis.Redis.from_url(stack.settings.redis_url)
    claim = Claim.decode(text(r.get(keys.request_idempotency_key("delete_adapter", tc.model_id, -1))))
    assert ResultStore(r).get(claim.request_id).ok  # the pool answered the queued delete_adapter
    r.close()

    unknown = cli("delete", "nobody-here")
    assert unknown.returncode == 2 and "nobody-here" in unknown.stderr and "Traceback" not in unknown.stderr


def test_cli_pool_drain_refuses_with_no_open_sibling_and_changes_nothing(stack, keys):
    """`loraplex pool drain NAME` of the only pool of its base model, with adapters on it: exit 2, one line naming
    why, and nothing changed: the pool is not drained, its adapters stay and train, no move is asked, a new adapter
    is still placed on it."""
    import re

    import redis

    from loraplex.queue import handoff
    from loraplex.service.build import build_services
    from loraplex.service.moves import placed_pool
    from loraplex.storage.repositories import PoolRepository

    pool = stack.settings.pool
    client = ServiceClient(stack.base_url, keys["t-one"])
    tc = client.create_lora_training_client(rank=4)
    refused = subprocess.run([sys.executable, "-m", "loraplex.launch.cli", "pool", "drain", pool],
                             env=stack.child_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    line = refused.stderr.strip()
    assert refused.returncode == 2 and "\n" not in line and "Traceback" not in line, refused.stderr
    assert re.fullmatch(rf"loraplex: pool '{pool}' has \d+ adapters and no open sibling pool of 'tiny' to take them "
                        r"\(siblings: none live\); nothing changed", line), line  # fmt: skip
    services = build_services(stack.settings)
    with services.sessions() as db:
        assert PoolRepository(db).draining([pool]) == set()
    assert placed_pool(services, tc.model_id) == pool
    assert handoff.move_orders(redis.Redis.from_url(stack.settings.redis_url), pool) == {}
    tc.forward_backward([Datum.for_next_token([1, 2, 3, 4])]).result(timeout=60)
    assert placed_pool(services, client.create_lora_training_client(rank=4).model_id) == pool
