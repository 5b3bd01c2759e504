"""Checkpoints end to end on the embedded stack (real pool): save_state and restore into a new adapter continue
bit-identically; save_weights_for_sampler + `loraplex export` give a PEFT folder that PEFT loads to the engine's
logprobs; other tenants get 404; tampered files fail the load; retention deletes expired checkpoints."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from loraplex.client import AdamParams, Datum, TrainingClient
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.storage.blobs import BlobStore
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.retention import delete_expired
from loraplex.storage.types import utcnow
from tests.helpers.stack import tenant_clients

ADAM = AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def clients(stack):
    return tenant_clients(stack, "ck-one", "ck-two")


def _data() -> list[Datum]:
    return [Datum.for_next_token([(5 + 11 * i + 3 * j) % 180 + 12 for j in range(14)]) for i in range(3)]


def _steps(trainer: TrainingClient, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        fb = trainer.forward_backward(_data())
        opt = trainer.optim_step(ADAM)
        losses.append(fb.result()["metrics"]["loss:sum"])
        opt.result()
    return losses


def _logprobs(trainer: TrainingClient) -> list[list[float]]:
    return [out["logprobs"] for out in trainer.forward(_data()).result()["loss_fn_outputs"]]


def test_restored_adapter_continues_bit_identically(clients):
    one = clients["ck-one"]
    trainer = one.create_lora_training_client(rank=8, seed=3)
    first = _steps(trainer, 3)
    saved = trainer.save_state("after-3").result()
    assert saved["path"] == f"tinker://{trainer.model_id}/weights/after-3"
    assert saved["kind"] == "state" and saved["step"] == 3 and saved["size_bytes"] > 0 and len(saved["sha256"]) == 64
    losses_a = _steps(trainer, 2)
    assert losses_a[-1] < first[0]

    restored = one.create_training_client_from_state(saved["path"])
    assert restored.model_id != trainer.model_id
    assert restored.info()["rank"] == 8
    losses_b = _steps(restored, 2)
    assert losses_b == losses_a  # exactly: weights, Adam moments and step count all restored
    assert _logprobs(restored) == _logprobs(trainer)

    # load_state into an existing adapter rewinds it to the checkpoint; the same two steps follow.
    trainer.load_state(saved["path"]).result()
    assert _steps(trainer, 2) == losses_a

    listed = trainer.list_checkpoints()
    assert [(c["tinker_path"], c["kind"], c["step"]) for c in listed] == [(saved["path"], "state", 3)]
    with pytest.raises(Exception) as clash:  # the name is taken
        trainer.save_state("after-3").result(timeout=30)
    assert "409" in str(clash.value)


def test_sampler_weights_export_to_peft_with_the_engines_logprobs(stack, clients, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = clients["ck-one"].create_lora_training_client(rank=4, alpha=12.0, seed=9)
    _steps(trainer, 2)
    saved = trainer.save_weights_for_sampler("for-export").result()
    assert saved["path"] == f"tinker://{trainer.model_id}/sampler_weights/for-export" and saved["step"] == 2
    expected = _logprobs(trainer)

    env = stack.child_env()
    out = tmp_path / "peft"
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.launch.cli", "export", trainer.model_id, "--out", str(out), "--tenant", "ck-one"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()

    base_dir = stack.settings.resolved_model_cache / stack.settings.base_model
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    assert model.peft_config["default"].base_model_name_or_path == str(base_dir.resolve())
    for datum, want in zip(_data(), expected, strict=True):
        ids = torch.tensor([list(datum.model_input)])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
        got = logprobs.gather(-1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])[:, 0]
        torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-5)

    # An adapter with nothing saved: a clear error, exit 1.
    bare = clients["ck-one"].create_lora_training_client(rank=4, seed=1)
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.launch.cli", "export", bare.model_id, "--out", str(tmp_path / "none")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "save one first" in done.stderr


def test_other_tenant_gets_404_and_tampered_files_fail_the_load(stack, clients):
    one, two = clients["ck-one"], clients["ck-two"]
    trainer = one.create_lora_training_client(rank=4, seed=2)
    _steps(trainer, 1)
    path = trainer.save_state("mine").result()["path"]
    with pytest.raises(NotFoundError):
        two.create_training_client_from_state(path)
    theirs = two.create_lora_training_client(rank=4, seed=2)
    with pytest.raises(NotFoundError):
        theirs.load_state(path).result(timeout=30)
    with pytest.raises(NotFoundError):
        two.list_checkpoints(trainer.model_id)

    # Flip one byte of the weights file: the load fails with a clear error and the adapter is untouched.
    before = _logprobs(trainer)
    folder = next((stack.settings.resolved_blob_root).rglob("mine"))
    weights = folder / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(InvalidRequestError, match="sha256|tampered|corrupt"):
        trainer.load_state(path).result()
    with pytest.raises(InvalidRequestError):
        one.create_training_client_from_state(path)
    assert _logprobs(trainer) == before


def test_retention_deletes_expired_checkpoints(stack, clients):
    trainer = clients["ck-one"].create_lora_training_client(rank=4, seed=4)
    keep = trainer.save_state("keep").result()["path"]
    temp = trainer.save_weights_for_sampler("temp", ttl_seconds=60).result()["path"]
    listed = {c["tinker_path"]: c for c in trainer.list_checkpoints()}
    assert listed[temp]["expires_at"] is not None and listed[keep]["expires_at"] is None
    deadline = time.monotonic() + 30  # a sampler save is answered before its files: wait for them to be written
    while listed[temp]["size_bytes"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
        listed = {c["tinker_path"]: c for c in trainer.list_checkpoints()}
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    blobs = BlobStore(stack.settings.resolved_blob_root)
    folder = next(p for p in blobs.root.rglob("temp") if trainer.model_id in str(p))
    assert delete_expired(sessions, blobs, now=utcnow()) == 0
    assert delete_expired(sessions, blobs, now=utcnow() + timedelta(seconds=120)) == 1
    assert [c["tinker_path"] for c in trainer.list_checkpoints()] == [keep]
    assert not folder.exists()
    with pytest.raises(NotFoundError):
        trainer.load_state(temp, with_optimizer=False).result(timeout=30)
