"""tinker-cookbook 0.6.1's supervised loop (`tinker_cookbook.supervised.train.main`), unchanged, against the embedded
stack: a local JSONL chat file, the pool's own tokenizer registered in process (no hub), to its end; then a run cut
short by max_steps and resumed from its last checkpoint (create-via-load with the optimizer), to the end."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplex.client import ServiceClient
from tests.helpers.stack import create_tenants

CONVERSATIONS = 16
BATCH = 4  # 4 steps per epoch


@pytest.fixture(scope="module")
def cookbook(stack, tmp_path_factory):
    """The cookbook's modules, with the pool's tokenizer registered under the pool's base model name."""
    pytest.importorskip("tinker_cookbook")
    from tinker_cookbook import tokenizer_utils

    folder = stack.settings.resolved_model_cache / stack.settings.base_model
    tokenizer_utils.register_tokenizer(
        stack.settings.base_model, lambda: AutoTokenizer.from_pretrained(folder, local_files_only=True)
    )
    data = tmp_path_factory.mktemp("cookbook") / "chats.jsonl"
    with data.open("w") as f:
        for i in range(CONVERSATIONS):
            messages = [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return data


def _config(stack, data: Path, log_path: Path, max_steps: int | None):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=stack.settings.base_model, renderer_name="role_colon", max_length=128, batch_size=BATCH
    )
    return train.Config(
        log_path=str(log_path),
        recipe_name="loraplex_e2e",
        model_name=stack.settings.base_model,
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(file_path=str(data), common_config=common),
        learning_rate=1e-3,
        lora_rank=8,
        base_url=stack.base_url,
        save_every=2,
        eval_every=0,
        max_steps=max_steps,
    )


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _run(stack, data: Path, log_path: Path, max_steps: int | None = None) -> None:
    from tinker_cookbook.supervised import train

    asyncio.run(train.main(_config(stack, data, log_path, max_steps)))


def test_the_supervised_loop_runs_to_its_end(stack, cookbook, tmp_path, monkeypatch) -> None:
    key = create_tenants(stack, "cookbook-sl")["cookbook-sl"]
    monkeypatch.setenv("TINKER_API_KEY", key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    log_path = tmp_path / "run"
    _run(stack, cookbook, log_path)
    rows = [r for r in _metrics(log_path) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["train_mean_nll"]) for r in rows)
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert saved and saved[-1]["name"] == "final"
    with ServiceClient(stack.base_url, key) as native:  # the run's checkpoints are real rows of this tenant
        paths = {c["tinker_path"] for c in native.list_all_checkpoints(limit=100)["checkpoints"]}
    assert saved[-1]["state_path"] in paths


def test_an_interrupted_run_resumes_from_its_last_checkpoint(stack, cookbook, tmp_path, monkeypatch) -> None:
    """A run that died after its step-2 save (its log holds the periodic checkpoint, no final one) is resumed by the
    cookbook: the rest of the steps train on an adapter restored with its optimizer state (create-via-load)."""
    key = create_tenants(stack, "cookbook-resume")["cookbook-resume"]
    monkeypatch.setenv("TINKER_API_KEY", key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    log_path = tmp_path / "run"
    _run(stack, cookbook, log_path, max_steps=3)
    records = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    periodic = [r for r in records if r["name"] != "final"]
    assert periodic and periodic[-1]["batch"] == 2
    (log_path / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in periodic))  # died after it

    _run(stack, cookbook, log_path)  # the same log_path: the cookbook resumes from checkpoints.jsonl
    rows = [r for r in _metrics(log_path) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["train_mean_nll"]) for r in rows)
    with ServiceClient(stack.base_url, key) as native:
        runs = {r["training_run_id"] for r in native.list_runs(limit=100)["training_runs"]}
    first_run = periodic[-1]["state_path"].split("/")[2]
    assert first_run in runs and len(runs) == 2  # the interrupted run's adapter, and the one restored from it
