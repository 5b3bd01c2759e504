"""Sampler copies (workers/state/adapter_store.py: freeze_copy): a named save_weights_for_sampler keeps a frozen copy of
the adapter's weights as an adapter of its own (in a free slot: a device-to-device copy; else in host memory), which
stays as it was while the adapter trains on, survives swaps through host memory and disk bit for bit, and never
reaches the SQL residency records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.sampling.sampler import Sampler
from loraplex.workers.sampling.step import SampleStep
from loraplex.workers.state.adapter_store import AdapterStore, is_sampler_copy_id

COPY = "tinker://a/sampler_weights/s1"
DATA = [{"model_input": [3, 5, 7, 9, 11], "loss_fn_inputs": {"target_tokens": [5, 7, 9, 11, 13]}}]


@pytest.fixture
def pool(tiny_dir: Path, tmp_path: Path) -> tuple[PlanExecutor, AdapterStore]:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=4))
    store = AdapterStore(engine, 1 << 30, tmp_path / "spill")
    return PlanExecutor(engine, store), store


def _same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[n][0], y[n][0]) and torch.equal(x[n][1], y[n][1]) for n in x)


def _req(rid: str, kind: RequestKind, seq: int, **payload) -> PlannedRequest:
    return PlannedRequest(rid, "t", "a", seq, kind, payload)


def _train(executor: PlanExecutor, seq: int) -> None:
    plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (_req(f"fb{seq}", RequestKind.FORWARD_BACKWARD, seq, data=DATA),)),
                      Step(StepKind.OPTIM_STEP, (_req(f"o{seq}", RequestKind.OPTIM_STEP, seq + 1,
                                                      adam_params={"learning_rate": 0.05}),)),))  # fmt: skip
    assert all(o.ok for o in executor.execute(plan))


def test_a_sampler_save_keeps_a_frozen_copy_while_the_adapter_trains_on(pool, tmp_path) -> None:
    executor, store = pool
    store.create("a", 4, 8.0, seed=1)
    _train(executor, 1)
    weights_then = store.engine.adapter_weights("a")
    save = _req("s", RequestKind.SAVE_SAMPLER, 3, name="s1", path=COPY, directory=str(tmp_path / "ckpt"))
    (saved,) = executor.execute(BatchPlan((Step(StepKind.CHECKPOINT, (save,)),)))
    assert saved.ok, saved.error
    assert store.tier_of(COPY) == "gpu" and is_sampler_copy_id(COPY)  # a free slot: the copy stays on the device
    engine = store.engine
    frozen = engine.read_slot(engine.adapter(COPY).slot)
    assert not frozen[1:].any()  # weights only: no gradients or Adam moments
    assert torch.equal(frozen[0], engine.read_slot(engine.adapter("a").slot, ("weights",))[0])
    _train(executor, 4)  # the adapter moves on
    store.ensure_resident([COPY])
    assert _same(store.engine.adapter_weights(COPY), weights_then)  # the copy is the weights at the save
    assert not _same(store.engine.adapter_weights("a"), weights_then)  # while the adapter trained on
    assert all(not is_sampler_copy_id(c.model_id) for c in store.drain_changes())  # no residency rows for sampler copies


def test_a_sampler_copy_survives_disk_and_a_second_save_replaces_it(tiny_dir: Path, tmp_path: Path) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=4))
    store = AdapterStore(engine, 0, tmp_path / "spill")  # no host budget: to disk
    store.create("a", 2, 4.0, seed=2)
    store.create("b", 2, 4.0, seed=3)  # no free slot: the sampler copy is a host copy (here spilled at once)
    store.freeze_copy("a", COPY)
    assert store.tier_of(COPY) == "disk" and store.engine.is_resident("b")
    assert not store.peek(COPY).rows[1:].any()  # weights only
    first = store.engine.adapter_weights("a")
    store.ensure_resident([COPY])
    assert _same(store.engine.adapter_weights(COPY), first)
    store.freeze_copy("a", COPY)  # the same name again (overwrite): one copy, the newest
    assert store.lru_order().count(COPY) == 1


def test_an_adapter_keeps_its_newest_copies_and_older_ones_reload_from_their_folder(pool, tmp_path) -> None:
    """An RL loop saves a sampler copy every iteration: the store keeps the newest `copies_per_adapter` (2 here), the
    older ones are dropped from memory, and a sample naming one loads it from its checkpoint folder again; deleting
    the adapter drops its copies."""
    executor, store = pool
    store.copies_per_adapter = 2
    store.create("a", 4, 8.0, seed=1)
    paths, saved_weights = [], []
    for k in range(4):
        _train(executor, 10 * k + 1)
        path = f"tinker://a/sampler_weights/it{k}"
        save = _req(f"s{k}", RequestKind.SAVE_SAMPLER, 10 * k + 3, name=f"it{k}", path=path,
                    directory=str(tmp_path / f"it{k}"))  # fmt: skip
        assert all(o.ok for o in executor.execute(BatchPlan((Step(StepKind.CHECKPOINT, (save,)),))))
        paths.append(path)
        saved_weights.append(store.engine.adapter_weights("a"))
    assert [p for p in paths if p in store] == paths[2:]  # the two newest
    step = SampleStep(Sampler(store.engine), store)
    step._have(paths[0], str(tmp_path / "it0"))  # reloaded from its folder: the weights of that save
    assert _same(store.engine.adapter_weights(paths[0]), saved_weights[0])
    store.delete("a")
    assert all(p not in store for p in paths[2:])


def test_an_older_copy_makes_room_for_a_new_one_and_is_dropped_not_spilled(tiny_dir: Path, tmp_path: Path) -> None:
    """No free slot for a new sampler copy: the older resident copy leaves its slot (the new one is a device copy,
    sampled next), and past the host budget it is dropped rather than written to disk (its checkpoint folder holds
    it: a sample naming it reloads it from there, the weights of its save)."""
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=4))
    store = AdapterStore(engine, 0, tmp_path / "spill")  # no host budget
    executor = PlanExecutor(engine, store)
    store.create("a", 4, 8.0, seed=1)
    saved = []
    for k in range(2):
        _train(executor, 10 * k + 1)
        save = _req(f"s{k}", RequestKind.SAVE_SAMPLER, 10 * k + 3, name=f"it{k}",
                    path=f"tinker://a/sampler_weights/it{k}", directory=str(tmp_path / f"it{k}"))  # fmt: skip
        assert all(o.ok for o in executor.execute(BatchPlan((Step(StepKind.CHECKPOINT, (save,)),))))
        saved.append(store.engine.adapter_weights("a"))
    first, second = "tinker://a/sampler_weights/it0", "tinker://a/sampler_weights/it1"
    assert first not in store and store.tier_of(second) == "gpu" and store.engine.is_resident("a")
    assert store.stats.spills == 0 and not any((tmp_path / "spill").iterdir())
    assert _same(store.engine.adapter_weights(second), saved[1])
    SampleStep(Sampler(store.engine), store)._have(first, str(tmp_path / "it0"))
    assert _same(store.engine.adapter_weights(first), saved[0])
