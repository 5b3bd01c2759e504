"""PEFT export through the client on the embedded stack (real pool): `TrainingClient.export_peft(dir)` downloads the
PEFT folder of a saved checkpoint (GET /v1/adapters/{id}/export, a tar archive) that PEFT loads to the engine's
per-token logprobs; another tenant's adapter and an adapter with nothing saved are 404s; a tampered checkpoint is a
400; a hostile archive is refused before anything is extracted."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch

from loraplex.client import AdamParams, Datum, TrainingClient
from loraplex.client.training import extract_tar
from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.launch.embedded import Stack
from tests.helpers.stack import tenant_clients

ADAM = AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def clients(stack):
    return tenant_clients(stack, "ex-one", "ex-two")


def _data() -> list[Datum]:
    return [Datum.for_next_token([(7 + 13 * i + 5 * j) % 200 + 9 for j in range(12 + i)]) for i in range(3)]


def _steps(trainer: TrainingClient, n: int) -> None:
    for _ in range(n):
        trainer.forward_backward(_data())
        trainer.optim_step(ADAM).result()


def _engine_logprobs(trainer: TrainingClient) -> list[list[float]]:
    return [out["logprobs"] for out in trainer.forward(_data()).result()["loss_fn_outputs"]]


def _peft_logprobs(stack: Stack, folder) -> list[torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = stack.settings.resolved_model_cache / stack.settings.base_model
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    out = []
    for datum in _data():
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(datum.model_input)])).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)[0]
        out.append(logprobs.gather(-1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None])[:, 0])
    return out


def test_client_export_loads_in_peft_with_the_engines_logprobs(stack, clients, tmp_path):
    one = clients["ex-one"]
    trainer = one.create_lora_training_client(rank=4, alpha=12.0, seed=5)
    with pytest.raises(NotFoundError, match="save one first"):  # nothing saved yet
        trainer.export_peft(tmp_path / "early")
    assert not (tmp_path / "early").exists()

    _steps(trainer, 2)
    saved = trainer.save_weights_for_sampler("for-client-export").result()
    expected = _engine_logprobs(trainer)

    out = trainer.export_peft(tmp_path / "peft")
    assert out == tmp_path / "peft"
    assert (out / "adapter_model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == stack.settings.base_model  # the name, not the gateway's folder
    assert config["r"] == 4 and config["lora_alpha"] == 12

    got = _peft_logprobs(stack, out)
    for g, want in zip(got, expected, strict=True):
        torch.testing.assert_close(g, torch.tensor(want), rtol=0, atol=1e-5)

    # An explicit checkpoint (tinker path, or kind/name) gives the same files; ServiceClient has the call too.
    by_path = trainer.export_peft(tmp_path / "by-path", checkpoint=saved["path"])
    by_name = one.export_peft(trainer.model_id, tmp_path / "by-name", checkpoint="sampler_weights/for-client-export")
    for folder in (by_path, by_name):
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (folder / name).read_bytes() == (out / name).read_bytes()
    with pytest.raises(NotFoundError):
        trainer.export_peft(tmp_path / "missing", checkpoint="weights/no-such")
    with pytest.raises(InvalidRequestError):
        trainer.export_peft(tmp_path / "bad", checkpoint="tinker://someone-else/weights/x")


def test_other_tenant_gets_404_and_a_tampered_checkpoint_400(stack, clients, tmp_path):
    one, two = clients["ex-one"], clients["ex-two"]
    trainer = one.create_lora_training_client(rank=4, seed=8)
    _steps(trainer, 1)
    path = trainer.save_state("state-export").result()["path"]
    assert (trainer.export_peft(tmp_path / "mine") / "adapter_config.json").is_file()  # a state checkpoint exports too

    with pytest.raises(NotFoundError):
        two.export_peft(trainer.model_id, tmp_path / "theirs")
    with pytest.raises(NotFoundError):
        two.export_peft(trainer.model_id, tmp_path / "theirs", checkpoint=path)
    assert not (tmp_path / "theirs").exists()

    folder = next(p for p in stack.settings.resolved_blob_root.rglob("state-export") if trainer.model_id in str(p))
    weights = folder / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(InvalidRequestError, match="cannot be exported.*sha256"):
        trainer.export_peft(tmp_path / "tampered")
    assert not (tmp_path / "tampered").exists()


def _archive(*members: tuple[tarfile.TarInfo, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


@pytest.mark.parametrize("name", ["../escape.txt", "/abs/escape.txt", "sub/../../escape.txt"])
def test_extract_refuses_unsafe_members(tmp_path, name):
    archive = _archive((tarfile.TarInfo("adapter_config.json"), b"{}"), (tarfile.TarInfo(name), b"x"))
    with pytest.raises(InvalidRequestError, match="unsafe path"):
        extract_tar(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape.txt").exists()


def test_extract_refuses_links(tmp_path):
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(InvalidRequestError, match="not a plain file"):
        extract_tar(_archive((link, b"")), tmp_path / "out")
    assert not (tmp_path / "out").exists()
