"""The client's runs and checkpoint management on the embedded stack (real pool, real saved files): runs listed and
read, checkpoints listed across runs newest first, weights_info, a time to live that the retention job honours, the
archive of a checkpoint's PEFT folder, bulk delete all or none; another tenant gets NotFoundError everywhere."""

from __future__ import annotations

import tarfile
from datetime import timedelta

import pytest

from loraplex.client import AdamParams, Datum
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.storage.blobs import BlobStore
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.retention import delete_expired
from loraplex.storage.types import utcnow
from tests.helpers.stack import tenant_clients


@pytest.fixture(scope="module")
def clients(stack):
    return tenant_clients(stack, "cm-one", "cm-two")


def _data() -> list[Datum]:
    return [Datum.for_next_token([(3 + 7 * i + 2 * j) % 150 + 10 for j in range(10)]) for i in range(2)]


def test_runs_and_checkpoints_across_them_through_the_client(stack, clients, tmp_path):
    one, two = clients["cm-one"], clients["cm-two"]
    first = one.create_lora_training_client(rank=4, seed=1, user_metadata={"renderer_name": "role_colon"})
    second = one.create_lora_training_client(rank=8, seed=2)
    first.forward_backward(_data())
    first.optim_step(AdamParams(learning_rate=1e-2)).result()
    state = first.save_state("s1").result()["path"]
    sampler = second.save_weights_for_sampler("w1").result()["path"]

    runs = one.list_runs(limit=1)
    assert [r["training_run_id"] for r in runs["training_runs"]] == [second.model_id]
    assert runs["cursor"] == {"offset": 0, "limit": 1, "total_count": 2}
    run = one.get_run(first.model_id)
    assert run["model_owner"] == "cm-one" and run["lora_rank"] == 4 and run["status"] == "ready"
    assert run["user_metadata"] == {"renderer_name": "role_colon"} and run["applied_seq_id"] == 3
    assert run["last_checkpoint"]["tinker_path"] == state and run["last_sampler_checkpoint"] is None

    page = one.list_all_checkpoints(limit=10)
    assert [c["tinker_path"] for c in page["checkpoints"]] == [sampler, state]
    assert page["cursor"]["total_count"] == 2
    assert [c["tinker_path"] for c in one.list_all_checkpoints(limit=1, offset=1)["checkpoints"]] == [state]
    info = one.weights_info(sampler)
    assert (info["lora_rank"], info["train_attn"], info["train_mlp"], info["kind"]) == (8, True, True, "sampler")
    assert info["size_bytes"] > 0

    # The archive of a checkpoint's PEFT folder, as a file.
    archive = one.download_checkpoint_archive(state, tmp_path / "state.tar")
    with tarfile.open(archive) as tar:
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(tar.getnames())

    # Another tenant: NotFoundError for each, and nothing of theirs changes.
    for call in (
        lambda: two.get_run(first.model_id),
        lambda: two.weights_info(state),
        lambda: two.set_checkpoint_ttl(state, 60),
        lambda: two.delete_checkpoints([state]),
        lambda: two.download_checkpoint_archive(state, tmp_path / "theirs.tar"),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert not (tmp_path / "theirs.tar").exists()
    assert two.list_runs()["training_runs"] == [] and two.list_all_checkpoints()["checkpoints"] == []
    with pytest.raises(InvalidRequestError, match="limit"):
        one.list_runs(limit=0)
    with pytest.raises(InvalidRequestError, match="ttl_seconds"):
        one.set_checkpoint_ttl(state, 0)

    # A time to live, honoured by the retention job; cleared again on the other.
    assert one.set_checkpoint_ttl(sampler, 60)["expires_at"] is not None
    assert one.set_checkpoint_ttl(state, 30)["expires_at"] is not None
    assert one.set_checkpoint_ttl(state, None)["expires_at"] is None
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    blobs = BlobStore(stack.settings.resolved_blob_root)
    folder = next(p for p in blobs.root.rglob("w1") if second.model_id in str(p))
    assert delete_expired(sessions, blobs, now=utcnow() + timedelta(seconds=120)) == 1
    assert not folder.exists()
    assert [c["tinker_path"] for c in one.list_all_checkpoints()["checkpoints"]] == [state]

    # Bulk delete: a missing path deletes nothing; then the checkpoints go, rows and files.
    again = first.save_weights_for_sampler("w2").result()["path"]
    with pytest.raises(NotFoundError, match="w1"):
        one.delete_checkpoints([state, sampler, again])
    assert len(one.list_all_checkpoints()["checkpoints"]) == 2
    deleted = one.delete_checkpoints([state, again])
    assert [c["tinker_path"] for c in deleted] == [state, again]
    assert one.list_all_checkpoints()["checkpoints"] == [] and one.get_run(first.model_id)["last_checkpoint"] is None
    with pytest.raises(NotFoundError):
        one.delete_checkpoint(state)
    with pytest.raises(NotFoundError):
        first.load_state(state).result(timeout=30)

    # A deleted run stays listed.
    first.delete()
    listed = {r["training_run_id"]: r["status"] for r in one.list_runs()["training_runs"]}
    assert listed == {first.model_id: "deleted", second.model_id: "ready"}
