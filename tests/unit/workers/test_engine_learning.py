"""The product demo's promise: one rank-8 adapter on the tiny model memorises 4 short sentences in seconds."""

from __future__ import annotations

import time

import pytest

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from tests.helpers.datums import datums

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: What is two plus two? Answer: Two plus two is four.",
    "Once upon a time there was a little village by the sea.",
    "Simple things should be simple.",
]
RANK, ALPHA, LR, STEPS = 8, 16.0, 1e-2, 30


def test_tiny_adapter_learns_fast(tmp_path_factory: pytest.TempPathFactory) -> None:
    model, tok = load_base_model("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=16))
    engine.create_adapter("demo", RANK, ALPHA, seed=0)
    data = []
    for text in SENTENCES:
        ids = tok.encode(text) + [tok.eos_token_id]
        data.append(
            {"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}}
        )
    start = time.perf_counter()
    losses = []
    for _ in range(STEPS):
        out = engine.forward_backward([engine.prepare("demo", datums(data), "cross_entropy", None, False)])
        losses.append(out[0]["metrics"]["loss:sum"])
        assert "metrics" in engine.optim_step([("demo", {"learning_rate": LR})])[0]
    elapsed = time.perf_counter() - start
    assert losses[-1] < 0.5 * losses[0], losses
    assert elapsed < 20, elapsed


def test_four_adapters_learn_different_tasks_in_one_mixed_batch(tmp_path_factory: pytest.TempPathFactory) -> None:
    model, tok = load_base_model("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    engine = build_engine(model, EngineConfig(num_slots=4, max_rank=16))
    tasks = {
        "counting": ["one two three four five six", "two three four five six seven"],
        "alphabet": ["a b c d e f g h", "b c d e f g h i"],
        "greetings": ["hello world, how are you", "good morning, dear friend"],
        "arithmetic": ["2+3=5 and 4+4=8", "1+1=2 and 3+3=6"],
    }
    data = {}
    for seed, (name, texts) in enumerate(tasks.items()):
        engine.create_adapter(name, RANK, ALPHA, seed=seed)
        data[name] = []
        for text in texts:
            ids = tok.encode(text)
            inputs = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
            data[name].append({"model_input": ids[:-1], "loss_fn_inputs": inputs})
    first = None
    for _ in range(STEPS):
        out = engine.forward_backward(
            [engine.prepare(name, datums(d), "cross_entropy", None, False) for name, d in data.items()]
        )
        engine.optim_step([(name, {"learning_rate": LR}) for name in data])
        losses = [o["metrics"]["loss:sum"] for o in out]
        first = first or losses
    assert all(last < 0.5 * start for start, last in zip(first, losses, strict=True)), (first, losses)
