"""storage.retention: expired checkpoints lose their rows and their folders; others (no expiry, or later) stay."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from loraplex.protocol.checkpoint_paths import checkpoint_blob_key
from loraplex.storage.blobs import BlobStore
from loraplex.storage.db import make_db_engine, migrate, session_factory
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository, TenantRepository, unit_of_work
from loraplex.storage.repositories.checkpoints import FILES_PENDING
from loraplex.storage.retention import delete_expired

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_delete_expired_removes_rows_and_files(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    sessions = session_factory(make_db_engine(url))
    blobs = BlobStore(tmp_path / "blobs")
    folders = {}
    with unit_of_work(sessions) as s:
        tenants = [TenantRepository(s).create_tenant(name)[0].id for name in ("a", "b")]
        for tenant in tenants:
            AdapterRepository(s, tenant).create(f"m-{tenant}", "tiny", 4, 8.0, ["q_proj"], 0)
        plan = [  # (tenant, name, expires_at)
            (tenants[0], "old", NOW - timedelta(seconds=1)),
            (tenants[0], "now", NOW),
            (tenants[0], "later", NOW + timedelta(hours=1)),
            (tenants[0], "forever", None),
            (tenants[1], "old", NOW - timedelta(days=3)),
            (tenants[1], "writing", NOW - timedelta(days=1)),  # files still being written (a sampler save)
        ]
        for tenant, name, expires in plan:
            key = checkpoint_blob_key(tenant, f"m-{tenant}", CheckpointKind.STATE, name)
            folder = blobs.path(key)
            folder.mkdir(parents=True)
            (folder / "adapter.safetensors").write_bytes(b"x" * 10)
            (folder / "metadata.json").write_text("{}")
            folders[(tenant, name)] = folder
            sha = FILES_PENDING if name == "writing" else "0" * 64
            CheckpointRepository(s, tenant).add(
                f"m-{tenant}", CheckpointKind.STATE, name, folder.as_uri(), 10, sha, expires_at=expires
            )

    assert delete_expired(sessions, blobs, now=NOW) == 3
    with sessions() as s:
        left = {(c.tenant_id, c.name) for t in tenants for c in CheckpointRepository(s, t).list(f"m-{t}")}
    assert left == {(tenants[0], "later"), (tenants[0], "forever"), (tenants[1], "writing")}
    for key, folder in folders.items():
        assert folder.is_dir() == (key in left), key
    # Nothing more is due now; an hour later "later" goes too; files already gone are no error.
    assert delete_expired(sessions, blobs, now=NOW) == 0
    assert delete_expired(sessions, blobs, now=NOW + timedelta(hours=2)) == 1
    assert not folders[(tenants[0], "later")].exists() and folders[(tenants[0], "forever")].is_dir()
    with unit_of_work(sessions) as s:  # its files land: the next sweep takes it
        written = CheckpointRepository(s, tenants[1]).get(f"m-{tenants[1]}", CheckpointKind.STATE, "writing")
        written.sha256 = "1" * 64
    assert delete_expired(sessions, blobs, now=NOW) == 1
    assert not folders[(tenants[1], "writing")].exists()


def test_a_folder_another_deleter_is_emptying_is_still_removed(tmp_path, monkeypatch) -> None:
    """Two deleters of one checkpoint's files (a delete request and the retention job): files the other removed while
    rmtree ran are not an error, and the folder goes. The race is made by removing a file from under rmtree's own
    unlink (os.unlink wrapped: a timing this test cannot otherwise cause)."""
    import os

    from loraplex.storage.retention import delete_checkpoint_files

    blobs = BlobStore(tmp_path / "blobs")
    folder = blobs.path("ckpt/one")
    folder.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json", "checkpoint.json"):
        (folder / name).write_bytes(b"x")
    real_unlink = os.unlink
    raced: list[str] = []

    def unlink_after_the_other_deleter(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not raced:  # the other deleter takes this file just before us
            raced.append(str(path))
            real_unlink(path, *args, **kwargs)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink_after_the_other_deleter)
    assert delete_checkpoint_files(blobs, folder.as_uri())
    assert raced and not folder.exists()
