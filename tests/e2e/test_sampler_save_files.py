"""A sampler save is answered once its weights are frozen, before its files are written, and its path still survives
a crash: an embedded stack of its own (real redis-server with its append-only file, SQLite, real pool and gateway
processes, the tiny model in fp32 on the CPU, durable snapshots and the request log on).

The pool's background writer is held by the test-only `test_hold_writes_file` (while that file exists no sampler file
is written): a pool killed between a save's answer and its files is the one fault nothing outside the pool can
cause, so the hold makes that window as long as the test needs. Everything else is real: the answer, sampling from
the frozen copy, listing, deleting, SIGKILL, the supervisor's restart and recovery.

Why `slots=1`: plans then hold one adapter's step at a time, as a replay runs them, so the rebuilt weights are
bit-identical (tests/e2e/test_recovery.py says why mixed plans are not)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.client import Datum, ServiceClient, TrainingClient
from loraplex.launch.embedded import Stack
from loraplex.protocol.checkpoint_files import WEIGHTS_FILE
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import SnapshotRepository
from tests.helpers.recovery import wait_restarted
from tests.helpers.stack import tenant_clients

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("sampler-files")
    settings = Settings(home=home, slots=1, max_rank=8, pool_heartbeat_seconds=0.5, leader_lease_seconds=2.0,
                        snapshot_every_steps=2, snapshot_every_seconds=0, restart_backoff_seconds=0.2,
                        test_hold_writes_file=home / "hold-writes")  # fmt: skip
    with Stack(settings, api_port=free_port()) as running:
        yield running


@pytest.fixture
def hold(stack: Stack) -> Iterator[Path]:
    path = stack.settings.test_hold_writes_file
    assert path is not None
    yield path
    path.unlink(missing_ok=True)


def _step(trainer: TrainingClient, k: int) -> None:
    tokens = list(range(20 + k, 33 + k))
    trainer.forward_backward([Datum(tokens[:-1], {"target_tokens": tokens[1:]})], "cross_entropy")
    trainer.optim_step({"learning_rate": 5e-2}).result()


def _sample(client: ServiceClient, path: str) -> tuple[list[list[int]], list[list[float]]]:
    sampler = client.create_sampling_client(model_path=path)
    out = sampler.sample(PROMPT, num_samples=2, max_tokens=8, temperature=1.0, seed=1234, stop=[]).result()
    return [s["tokens"] for s in out["sequences"]], [s["logprobs"] for s in out["sequences"]]


def _folder(stack: Stack, trainer: TrainingClient, name: str) -> Path:
    (found,) = Path(stack.settings.resolved_blob_root).glob(f"*/{trainer.model_id}/sampler/{name}")
    return found


def _snapshot_seq_ids(stack: Stack, trainer: TrainingClient) -> list[int]:
    with session_factory(make_db_engine(stack.settings.resolved_database_url))() as session:
        return [s.applied_seq_id for s in SnapshotRepository(session).newest_first(trainer.model_id)]


def _listed(trainer: TrainingClient, name: str) -> dict | None:
    return next((c for c in trainer.list_checkpoints() if c["name"] == name and c["kind"] == "sampler"), None)


def _wait(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_save_answers_before_its_files_samples_at_once_and_survives_a_sigkill(stack: Stack, hold: Path) -> None:
    client = tenant_clients(stack, "files-alice")["files-alice"]
    trainer = client.create_lora_training_client(rank=8, seed=5)
    for k in range(3):  # a snapshot after the 2nd step; the 3rd lies in the request log
        _step(trainer, k)
    reference = trainer.save_weights_for_sampler("reference").result()["path"]  # a fault-free save of these weights
    _wait(lambda: (_listed(trainer, "reference") or {}).get("sha256") is not None)
    reference_bytes = (_folder(stack, trainer, "reference") / WEIGHTS_FILE).read_bytes()

    hold.touch()
    saved = trainer.save_weights_for_sampler("held").result(timeout=30)  # answered although no file can be written
    blobs = Path(stack.settings.resolved_blob_root)
    assert not list(blobs.glob(f"*/{trainer.model_id}/sampler/held")), "the file was written before the answer"
    assert "sha256" not in saved and "size_bytes" not in saved  # answered before the files (their hash comes later)
    listed = _listed(trainer, "held")
    assert listed is not None and listed["size_bytes"] is None and listed["sha256"] is None  # listed, files pending
    before = _sample(client, saved["path"])  # sampled from the frozen copy, before any file exists
    assert before == _sample(client, reference)  # the same weights as the fault-free save
    _step(trainer, 3)  # trains on: a snapshot is due now, and must not be recorded past the unwritten save
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # (recorded past it, a restart could not replay up to the save)
        assert _snapshot_seq_ids(stack, trainer) == [4], "a snapshot was recorded past the unwritten save"
        time.sleep(0.1)
    assert not list(blobs.glob(f"*/{trainer.model_id}/sampler/held"))

    old = stack.child("pool").proc
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)  # answered, its files never written
    old.wait(timeout=30)
    hold.unlink()
    wait_restarted(stack, old.pid)

    listed = _listed(trainer, "held")  # recovery replayed the log up to the save and wrote its files
    assert listed is not None and listed["sha256"] is not None and listed["size_bytes"] > 0
    folder = _folder(stack, trainer, "held")
    assert (folder / WEIGHTS_FILE).read_bytes() == reference_bytes  # what a fault-free run writes, bit for bit
    assert _sample(client, saved["path"]) == before  # the same tokens and logprobs as before the kill
    _step(trainer, 4)  # the adapter goes on from the replayed state
    assert _listed(trainer, "held")["step"] == _listed(trainer, "reference")["step"]


def test_a_checkpoint_deleted_while_its_files_are_pending_leaves_no_files(stack: Stack, hold: Path) -> None:
    client = tenant_clients(stack, "files-bob")["files-bob"]
    trainer = client.create_lora_training_client(rank=8, seed=6)
    _step(trainer, 0)
    hold.touch()
    saved = trainer.save_weights_for_sampler("doomed").result()
    kept = trainer.save_weights_for_sampler("kept").result()
    assert _listed(trainer, "doomed")["sha256"] is None
    trainer.delete_checkpoint(saved["path"])  # while its files are still to be written
    assert _listed(trainer, "doomed") is None
    hold.unlink()  # the writer goes on: the deleted save's files are written, then removed
    _wait(lambda: (_listed(trainer, "kept") or {}).get("sha256") is not None)
    blobs = Path(stack.settings.resolved_blob_root)
    assert not list(blobs.glob(f"*/{trainer.model_id}/sampler/doomed"))
    assert list(blobs.glob(f"*/{trainer.model_id}/sampler/kept"))
    assert _sample(client, kept["path"])[0]


def test_an_export_of_a_save_waits_for_its_files(stack: Stack, hold: Path, tmp_path: Path) -> None:
    client = tenant_clients(stack, "files-carol")["files-carol"]
    trainer = client.create_lora_training_client(rank=8, seed=7)
    _step(trainer, 0)
    hold.touch()
    saved = trainer.save_weights_for_sampler("exported").result()
    assert _listed(trainer, "exported")["sha256"] is None
    # The export waits on the gateway while the files are pending; released a moment later, it answers the files.
    threading.Timer(1.0, hold.unlink).start()
    folder = trainer.export_peft(tmp_path / "peft", saved["path"])
    assert (folder / "adapter_model.safetensors").is_file()
