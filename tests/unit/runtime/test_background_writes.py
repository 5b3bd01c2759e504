"""A sampler save's files are written beside the training path (loraplex/runtime/background_writes.py): the plan only copies
the weights; the file, written later from that copy, holds the weights at the save even when the adapter trained on
before the write ran; a later plan reading the same folder waits for the write; a failed write is the save's error."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from loraplex.errors import InvalidRequestError
from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import SaveResult
from loraplex.runtime.background_writes import BackgroundWrites
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.state.adapter_store import AdapterStore
from loraplex.workers.state.checkpoint import read_checkpoint

DATA = [{"model_input": [3, 5, 7, 9, 11], "loss_fn_inputs": {"target_tokens": [5, 7, 9, 11, 13]}}]


@pytest.fixture
def pool(tiny_dir: Path, tmp_path: Path):
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=3, max_rank=4))
    writes = BackgroundWrites()
    executor = PlanExecutor(engine, AdapterStore(engine, 1 << 30, tmp_path / "spill"), writes=writes)
    executor.store.create("a", 4, 8.0, seed=1)
    yield executor, writes
    writes.close()


def _req(rid: str, kind: RequestKind, seq: int, **payload) -> PlannedRequest:
    return PlannedRequest(rid, "t", "a", seq, kind, payload)


def _run(executor: PlanExecutor, kind: StepKind, request: PlannedRequest):
    (outcome,) = executor.execute(BatchPlan((Step(kind, (request,)),)))
    return outcome


def _train(executor: PlanExecutor, seq: int) -> None:
    assert _run(executor, StepKind.FORWARD_BACKWARD, _req(f"fb{seq}", RequestKind.FORWARD_BACKWARD, seq, data=DATA)).ok
    step = _req(f"o{seq}", RequestKind.OPTIM_STEP, seq + 1, adam_params={"learning_rate": 0.05})
    assert _run(executor, StepKind.OPTIM_STEP, step).ok


def _gate(writes: BackgroundWrites) -> threading.Event:
    """Hold the writer thread (one thread: every later write waits behind this job) until the event is set."""
    release = threading.Event()
    writes.submit("gate", "gate", lambda: (release.wait(10), {})[1])
    return release


def _save(tmp_path: Path, rid: str = "s", name: str = "s1") -> PlannedRequest:
    return _req(rid, RequestKind.SAVE_SAMPLER, 3, name=name, path=f"tinker://a/sampler_weights/{name}",
                directory=str(tmp_path / name))  # fmt: skip


def test_the_file_holds_the_weights_of_the_save_though_the_adapter_trained_before_it_was_written(pool, tmp_path):
    executor, writes = pool
    _train(executor, 1)
    then = executor.engine.adapter_weights("a")
    release = _gate(writes)
    saved = _run(executor, StepKind.CHECKPOINT, _save(tmp_path))
    assert saved.ok and saved.result.expect(SaveResult).sha256 is None and writes.pending("s")  # the plan did not write the file
    assert not (tmp_path / "s1").exists()
    _train(executor, 4)  # the adapter moves on before the write runs
    release.set()
    files = writes.take("s")
    assert files["size_bytes"] > 0 and len(files["sha256"]) == 64
    state = read_checkpoint(tmp_path / "s1")
    for name, (a, b) in then.items():  # PEFT layout in the file: A [r, in], B [out, r]
        assert torch.equal(state.weights[name][0], a.t()) and torch.equal(state.weights[name][1], b.t())


def test_loading_a_folder_still_being_written_waits_for_it(pool, tmp_path):
    executor, writes = pool
    _train(executor, 1)
    release = _gate(writes)
    assert _run(executor, StepKind.CHECKPOINT, _save(tmp_path)).ok
    threading.Timer(0.3, release.set).start()
    load = _req("l", RequestKind.LOAD_STATE, 4, path="tinker://a/sampler_weights/s1", directory=str(tmp_path / "s1"),
                with_optimizer=False)  # fmt: skip
    loaded = _run(executor, StepKind.CHECKPOINT, load)
    assert loaded.ok, loaded.error  # read after the write finished, not a missing folder


def test_a_failed_write_is_the_saves_error(pool, tmp_path):
    executor, writes = pool
    (tmp_path / "blocked").write_text("a file where the folder should go")
    saved = _run(executor, StepKind.CHECKPOINT, _save(tmp_path, name="blocked"))
    assert saved.ok  # the plan's part went well
    with pytest.raises(InvalidRequestError, match="not a checkpoint directory"):
        writes.take("s")
