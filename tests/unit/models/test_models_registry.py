"""Base-model registry: the tiny preset is built deterministically and once, loads offline, and real shapes are right."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from loraplex.errors import InvalidRequestError
from loraplex.models import build_preset_model, load_base_model, resolve, weights_digest


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "model-cache"


def test_tiny_same_weights_across_processes_without_service_deps(cache: Path, tmp_path: Path) -> None:
    """A second process (that cannot import the service stack, like the GPU machine) builds identical weights."""
    model, _ = load_base_model("tiny", cache)
    other = tmp_path / "elsewhere"
    code = (
        "import sys\n"
        "for name in ('redis', 'sqlalchemy', 'fastapi', 'pydantic', 'pydantic_settings', 'celery', 'peft'):\n"
        "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
        "import loraplex.workers.engine.executor, loraplex.workers.engine.engine\n"
        "from loraplex.models import load_base_model, weights_digest\n"
        "m, _ = load_base_model('tiny', sys.argv[1])\n"
        "print(weights_digest(m))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(other)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == weights_digest(model)
    assert (other / "tiny" / "tokenizer.json").read_bytes() == (cache / "tiny" / "tokenizer.json").read_bytes()
    assert (other / "tiny" / "model.safetensors").read_bytes() == (cache / "tiny" / "model.safetensors").read_bytes()


def test_concurrent_builders_produce_one_complete_folder(tmp_path: Path) -> None:
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(resolve("tiny", tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert paths == [tmp_path / "tiny"] * 4
    leftovers = [p.name for p in tmp_path.iterdir() if p.is_dir() and p.name != "tiny"]
    assert leftovers == []  # temp build folders are renamed or removed
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "tiny").iterdir()}


def test_tiny_loads_from_its_folder_offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = resolve("tiny", cache)
    by_name, tok = load_base_model("tiny", cache)
    by_path, _ = load_base_model(str(folder), cache)
    assert weights_digest(by_name) == weights_digest(by_path)
    cfg = by_path.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        64,
        2,
        4,
        2,
        16,
    )
    assert cfg.intermediate_size == 128 and cfg.vocab_size == len(tok) == 512
    assert cfg.tie_word_embeddings is False and by_path.lm_head.weight is not by_path.model.embed_tokens.weight
    assert next(by_path.parameters()).dtype == torch.float32 and not by_path.training


def test_tiny_tokenizer_round_trips_text(cache: Path) -> None:
    _, tok = load_base_model("tiny", cache)
    for text in ["The quick brown fox jumps over the lazy dog.", "Zebra 42 ünïcode ✓ {json: [1, 2]}\n\ttabs", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.eos_token_id != tok.pad_token_id
    assert len(tok.encode("The quick brown fox")) < len("The quick brown fox")  # merges were learned


def test_unknown_names_and_folderless_presets_are_rejected(cache: Path) -> None:
    with pytest.raises(InvalidRequestError, match="unknown base model"):
        resolve("Qwen/Qwen3-0.6B", cache)
    with pytest.raises(InvalidRequestError, match="build_preset_model"):
        resolve("qwen3-4b-shape", cache)
    with pytest.raises(InvalidRequestError):
        build_preset_model("tiny")


@pytest.mark.parametrize(
    ("name", "hidden", "layers", "heads", "inter", "params_b"),
    [("qwen3-0.6b-shape", 1024, 28, 16, 3072, 0.596), ("qwen3-4b-shape", 2560, 36, 32, 9728, 4.022)],
)
def test_real_shape_presets(name: str, hidden: int, layers: int, heads: int, inter: int, params_b: float) -> None:
    model = build_preset_model(name, torch.bfloat16, "meta")  # shapes only: nothing allocated
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (
        hidden,
        layers,
        heads,
        inter,
    )
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (8, 128, 151936)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as those models ship
    assert next(model.parameters()).dtype == torch.bfloat16
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - params_b) < 0.01


def test_shape_preset_through_load_base_model(cache: Path) -> None:
    model, tok = load_base_model("qwen3-0.6b-shape", cache, dtype=torch.bfloat16, device="meta")
    assert model.config.vocab_size == 151936 and len(tok) <= model.config.vocab_size
