"""PEFT export (service/peft_export.py, torch-free): `PeftModel.from_pretrained(fresh base, out_dir)` of the folder
exported from a saved checkpoint gives the logits of our engine for that adapter (fp32); the weights file holds the
checkpoint's tensors exactly; adapter_config.json's fields; the tokenizer travels; the export loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors import safe_open
from transformers import AutoTokenizer

from loraplex.errors import InvalidRequestError
from loraplex.models import load_base_model
from loraplex.service.peft_export import export_checkpoint
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import Routing
from loraplex.workers.state.checkpoint import CheckpointState, write_checkpoint
from loraplex.workers.state.checkpoint_state import state_from_engine
from tests.helpers.datums import datums
from tests.helpers.peft import export_peft

ADAPTERS = {"a": (4, 8.0, 1), "b": (8, 12.5, 2)}  # model_id: (rank, alpha, seed); alpha 12.5 is not an integer


def make_data(seed: int, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        ids = torch.randint(0, 512, (n + 1,), generator=g).tolist()
        data.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}})
    return data


SEQUENCES = make_data(9, [7, 16, 3])


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    """Two trained adapters (B far from zero) side by side in one engine."""
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=3, max_rank=8))
    for model_id, (rank, alpha, seed) in ADAPTERS.items():
        engine.create_adapter(model_id, rank, alpha, seed)
    data = make_data(1, [12, 9])
    for _ in range(4):
        engine.forward_backward([engine.prepare(m, datums(data), "cross_entropy", None, False) for m in ADAPTERS])
        engine.optim_step([(m, {"learning_rate": 2e-2}) for m in ADAPTERS])
    return engine


def engine_logits(engine: Engine, model_id: str, ids: list[int]) -> torch.Tensor:
    """The engine model's full logits for one sequence routed to `model_id`'s slot."""
    record = engine.adapter(model_id)
    tokens = torch.tensor([ids])
    routing = Routing.build([record.slot], [record.rank], [record.scale], [tokens.numel()], engine.device)
    with engine.context.use(routing), torch.no_grad():
        return engine.model(input_ids=tokens).logits[0].float()


@pytest.mark.parametrize("model_id", sorted(ADAPTERS))
def test_peft_loads_export_to_engine_logits(engine: Engine, tiny_dir: Path, tmp_path: Path, model_id: str) -> None:
    state: CheckpointState = state_from_engine(engine, model_id, base_model="tiny", with_optimizer=False)
    write_checkpoint(state, tmp_path / "ckpt")
    out = export_checkpoint(
        tmp_path / "ckpt", tmp_path / "export", base_model_path=str(tiny_dir), tokenizer_dir=tiny_dir
    )
    assert out == tmp_path / "export"
    # The weights file: PEFT's key names, the checkpoint's fp32 values exactly, torch's metadata.
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == {f"base_model.model.{m}.lora_{p}.weight" for m in state.modules for p in "AB"}
        for name, (a, b) in state.weights.items():
            for part, t in zip("AB", (a, b), strict=True):
                got = f.get_tensor(f"base_model.model.{name}.lora_{part}.weight")
                assert got.dtype == torch.float32 and torch.equal(got, t)

    base, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    peft_model = PeftModel.from_pretrained(base, out).eval()
    loaded = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert len(loaded) == 2 * len(state.modules)  # every module got its adapter
    for name, (a, b) in state.weights.items():
        assert torch.equal(loaded[f"base_model.model.{name}.lora_A.default.weight"], a)
        assert torch.equal(loaded[f"base_model.model.{name}.lora_B.default.weight"], b)

    rank, alpha, _ = ADAPTERS[model_id]
    forward = engine.forward_backward([engine.prepare(model_id, datums(SEQUENCES), "cross_entropy", None, True)])[0]
    for datum, ours in zip(SEQUENCES, forward["loss_fn_outputs"], strict=True):
        ids = datum["model_input"]
        with torch.no_grad():
            theirs = peft_model(input_ids=torch.tensor([ids])).logits[0].float()
        assert (theirs - engine_logits(engine, model_id, ids)).abs().max() <= 1e-5
        # ...and the engine's own (fused) training path gives the same target logprobs.
        targets = torch.tensor(datum["loss_fn_inputs"]["target_tokens"])
        peft_lp = theirs.log_softmax(-1).gather(1, targets[:, None])[:, 0]
        assert (torch.tensor(ours["logprobs"]) - peft_lp).abs().max() <= 1e-5
    # The adapter matters: the bare base model differs.
    with torch.no_grad(), peft_model.disable_adapter():
        bare = peft_model(input_ids=torch.tensor([SEQUENCES[1]["model_input"]])).logits[0]
    assert (bare - engine_logits(engine, model_id, SEQUENCES[1]["model_input"])).abs().max() > 1e-3

    config = LoraConfig.from_pretrained(out)
    assert (config.r, config.lora_alpha) == (rank, alpha)


def test_adapter_config_and_tokenizer(engine: Engine, tiny_dir: Path, tmp_path: Path) -> None:
    state = state_from_engine(engine, "b", base_model="tiny", with_optimizer=True)  # the optimizer is not exported
    out = export_peft(state, tmp_path / "nested" / "out", base_model_path=str(tiny_dir), tokenizer_dir=tiny_dir)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 12.5
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["lora_dropout"] == 0.0 and config["bias"] == "none"
    assert config["base_model_name_or_path"] == str(tiny_dir)
    assert config["modules_to_save"] is None and config["use_dora"] is False and config["use_rslora"] is False
    files = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(name.startswith(".") for name in files)  # no temporaries
    assert "model.safetensors" not in files and "config.json" not in files  # the base model is referenced, not copied
    ours = AutoTokenizer.from_pretrained(out, local_files_only=True)
    base = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert ours.get_vocab() == base.get_vocab()
    assert ours("the quick brown fox")["input_ids"] == base("the quick brown fox")["input_ids"]

    # Defaults: no tokenizer, the checkpoint's base model name; an integer alpha stays an integer.
    a = state_from_engine(engine, "a", base_model="tiny", with_optimizer=False)
    plain = export_peft(a, tmp_path / "plain")
    assert {p.name for p in plain.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    config = json.loads((plain / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny" and config["lora_alpha"] == 8 and config["r"] == 4
    # Re-exporting over an earlier export replaces it.
    export_peft(state, tmp_path / "plain")
    assert json.loads((plain / "adapter_config.json").read_text())["r"] == 8


def test_tokenizer_dir_without_tokenizer_is_refused(engine: Engine, tmp_path: Path) -> None:
    state = state_from_engine(engine, "a", base_model="tiny", with_optimizer=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match="no tokenizer files"):
        export_peft(state, tmp_path / "out", base_model_path=None, tokenizer_dir=tmp_path / "empty")
    assert not (tmp_path / "out").exists()


def test_the_export_loads_no_torch() -> None:
    """The gateway and the Celery workers export without the engine's stack."""
    code = (
        "import sys, loraplex.service.peft_export, loraplex.api.routes.export, loraplex.launch.cli; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
