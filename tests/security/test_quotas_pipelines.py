"""Per-tenant checkpoint quotas and owner-only files, against a real embedded stack
(redis-server, SQLite, the gateway, a CPU pool on the tiny model) with small quotas.

A tenant keeps at most `max_checkpoints_per_tenant`
checkpoints and `max_checkpoint_bytes_per_tenant` bytes, saves still queued counted in; a save past either is a 429
naming the quota and its setting, with no Retry-After, and its seq_id is filled so the adapter's next step runs.
The database and blob files are owner-only (0600)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from loraplex.client import Datum, ServiceClient
from loraplex.client.futures import APIFuture
from loraplex.errors import CapacityError, QuotaExceededError
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories import CheckpointRepository, unit_of_work
from tests.security.harness import running_stack, tenant_key

MAX_CHECKPOINTS = 4
MAX_BYTES = 2**30
SAVES = 10  # > MAX_CHECKPOINTS, all sent while a slow step holds the adapter's earlier seq_id


@pytest.fixture(scope="module")
def quota_stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("quotas")
    with running_stack(home, max_checkpoints_per_tenant=MAX_CHECKPOINTS, max_checkpoint_bytes_per_tenant=MAX_BYTES,
                       snapshot_every_steps=1) as stack:  # fmt: skip
        yield stack


def client_for(stack, name: str) -> ServiceClient:
    return ServiceClient(stack.base_url, tenant_key(stack, name))


def slow_step(trainer):
    """A forward_backward of ~16k tokens: the saves queued behind it (seq_id order) cannot finish before it does."""
    data = [Datum.for_next_token([(7 * i + j) % 200 + 10 for j in range(512)]) for i in range(32)]
    return trainer.forward_backward(data)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_saves_past_the_checkpoint_count_quota_are_429_queued_ones_counted(quota_stack) -> None:
    """Ten save_state calls sent while none can have finished: exactly MAX_CHECKPOINTS are accepted (the queued saves
    count), the rest are 429 QuotaExceededError naming LORAPLEX_MAX_CHECKPOINTS_PER_TENANT without Retry-After; the
    adapter's next step still runs (each refused seq_id was filled), a retry of a refused save gets the refusal's
    future, and deleting a checkpoint makes room for one more."""
    key = tenant_key(quota_stack, "hoarder")
    client = ServiceClient(quota_stack.base_url, key)
    trainer = client.create_lora_training_client(rank=4, seed=1)
    slow = slow_step(trainer)
    accepted, refused = [], []
    for save in [trainer.save_state(f"s{i}") for i in range(SAVES)]:  # sent on the client's threads, concurrently
        try:
            assert save.request_id  # the gateway queued it...
            accepted.append(save)
        except CapacityError as exc:  # ...or refused it: 429 (the server's QuotaExceededError)
            refused.append(exc)
    assert len(accepted) == MAX_CHECKPOINTS and len(refused) == SAVES - MAX_CHECKPOINTS, (accepted, refused)
    assert all("LORAPLEX_MAX_CHECKPOINTS_PER_TENANT" in exc.message for exc in refused), refused[0]
    slow.result(timeout=120)
    started = time.monotonic()
    after = trainer.forward_backward([Datum.for_next_token([11, 12, 13, 14])]).result(timeout=30)
    assert "loss:sum" in after["metrics"] and time.monotonic() - started < 10  # no wait for a gap in the chain
    paths = [f.result(timeout=60)["path"] for f in accepted]
    assert len(trainer.list_checkpoints()) == MAX_CHECKPOINTS

    # The refusal over plain HTTP: 429, no Retry-After (waiting frees nothing); the same seq_id again (an SDK retries
    # a 429) answers the refusal's future, whose error is the quota's.
    with httpx.Client(base_url=quota_stack.base_url, headers={"X-API-Key": key}) as http:
        seq = trainer._take_seq()
        body = {"seq_id": seq, "name": "over", "ttl_seconds": None, "overwrite": False}
        first = http.post(f"/v1/adapters/{trainer.model_id}/save_state", json=body)
        assert first.status_code == 429 and "retry-after" not in first.headers, first.text
        assert "LORAPLEX_MAX_CHECKPOINTS_PER_TENANT" in first.json()["detail"]
        again = http.post(f"/v1/adapters/{trainer.model_id}/save_state", json=body)
        assert again.status_code == 202, again.text
    with pytest.raises(QuotaExceededError, match="LORAPLEX_MAX_CHECKPOINTS_PER_TENANT"):
        APIFuture(client._transport, again.json()["request_id"], trainer.model_id).result(timeout=30)

    trainer.delete_checkpoint(paths[0])
    assert trainer.save_state("after-delete").result(timeout=60)["path"].endswith("/after-delete")
    with pytest.raises(CapacityError, match="LORAPLEX_MAX_CHECKPOINTS_PER_TENANT"):
        trainer.save_weights_for_sampler("one-too-many").result(timeout=30)
    # Another tenant is not held back by this one's quota.
    other = client_for(quota_stack, "neighbour").create_lora_training_client(rank=4, seed=2)
    assert other.save_weights_for_sampler("mine").result(timeout=60)["path"]


def test_a_save_past_the_bytes_quota_is_429(quota_stack) -> None:
    """A tenant whose checkpoints hold MAX_BYTES (one row of that size recorded in SQL) cannot save more: 429 naming
    LORAPLEX_MAX_CHECKPOINT_BYTES_PER_TENANT; its adapter's next step runs."""
    client = client_for(quota_stack, "heavy")
    trainer = client.create_lora_training_client(rank=4, seed=3)
    trainer.forward_backward([Datum.for_next_token([5, 6, 7, 8])]).result(timeout=30)
    factory = session_factory(make_db_engine(quota_stack.settings.resolved_database_url))
    with unit_of_work(factory) as db:
        tenant_id = db.execute(text("SELECT tenant_id FROM adapters WHERE model_id = :m"),
                               {"m": trainer.model_id}).scalar_one()  # fmt: skip
        CheckpointRepository(db, tenant_id).add(trainer.model_id, CheckpointKind.STATE, "huge", "file:///nowhere",
                                                MAX_BYTES, "0" * 64)  # fmt: skip
    with pytest.raises(CapacityError, match="LORAPLEX_MAX_CHECKPOINT_BYTES_PER_TENANT"):
        trainer.save_state("more").result(timeout=30)
    assert "loss:sum" in trainer.forward_backward([Datum.for_next_token([5, 6, 7, 8])]).result(timeout=30)["metrics"]


def test_database_and_blob_files_are_owner_only(quota_stack) -> None:
    """After the stack wrote its database, a checkpoint and a durable snapshot: the SQLite file and its -wal and
    -shm are 0600, the blob store's root and the checkpoint's folders 0700, their files 0600."""
    client = client_for(quota_stack, "modes")
    trainer = client.create_lora_training_client(rank=4, seed=4)
    trainer.forward_backward([Datum.for_next_token([5, 6, 7, 8])])
    trainer.optim_step({"learning_rate": 1e-3}).result(timeout=30)
    path = trainer.save_state("kept").result(timeout=60)["path"]
    assert path
    settings = quota_stack.settings
    database = Path(settings.resolved_database_url.removeprefix("sqlite:///"))
    for f in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
        assert f.exists() and mode(f) == 0o600, (f, oct(mode(f)))
    root = Path(settings.resolved_blob_root)
    assert mode(root) == 0o700, oct(mode(root))
    folder = next(p for p in root.rglob("kept") if p.is_dir())
    deadline = time.monotonic() + 30
    while not list(folder.parent.parent.glob("snapshots/*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.2)
    snapshots = list(folder.parent.parent.glob("snapshots/*.safetensors"))
    assert snapshots, "no durable snapshot written"
    for d in (folder, folder.parent, folder.parent.parent, folder.parent.parent.parent, snapshots[0].parent):
        assert mode(d) == 0o700, (d, oct(mode(d)))
    files = [*folder.iterdir(), *snapshots]
    assert files and all(mode(f) == 0o600 for f in files), [(f.name, oct(mode(f))) for f in files]
    assert os.stat(database).st_uid == os.getuid()


def test_the_unnamed_sampler_save_obeys_the_quota(quota_stack) -> None:
    """The unnamed sampler save (save_weights_and_get_sampling_client) obeys the quota too."""
    client = client_for(quota_stack, "sampler-saver")
    trainer = client.create_lora_training_client(rank=4, seed=5)
    for i in range(MAX_CHECKPOINTS):
        trainer.save_weights_for_sampler(f"w{i}").result(timeout=60)
    with pytest.raises(CapacityError, match="LORAPLEX_MAX_CHECKPOINTS_PER_TENANT"):
        trainer.save_weights_and_get_sampling_client()
