"""The tiered adapter store (workers/state/adapter_store.py): exact swaps through host memory and disk, LRU, deletes, limits,
the change log, spill files, recovery, and the executor going through it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from loraplex.errors import CapacityError, ConflictError, NotFoundError
from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.state.adapter_store import AdapterStore, TierChange
from loraplex.workers.state.slot_images import SlotImage
from tests.helpers.datums import datums, with_datums

ADAM = {"learning_rate": 2e-2, "weight_decay": 0.01, "grad_clip_norm": 1.0}


@pytest.fixture(params=["tiny"])
def make_engine(request: pytest.FixtureRequest, tiny_dir: Path) -> Callable[..., Engine]:
    """Engines on the tiny model; a test parametrized indirectly with "tiny-moe" gets the MoE preset (expert banks)."""
    folder = tiny_dir if request.param == "tiny" else request.getfixturevalue("tiny_moe_dir")

    def make(slots: int = 2, max_rank: int = 4) -> Engine:
        model, _ = load_base_model(str(folder), folder.parent)  # fp32
        return build_engine(model, EngineConfig(num_slots=slots, max_rank=max_rank))

    return make


def data(step: int, n: int = 2) -> list[dict]:
    out = []
    for i in range(n):
        toks = [(step * 31 + i * 7 + j * 3) % 500 + 1 for j in range(9)]
        out.append({"model_input": toks[:-1], "loss_fn_inputs": {"target_tokens": toks[1:], "weights": [1.0] * 8}})
    return out


def same_state(a: SlotImage, b: SlotImage) -> bool:
    return torch.equal(a.rows, b.rows) and (a.step, a.rank, a.alpha, a.seed) == (b.step, b.rank, b.alpha, b.seed)


@pytest.mark.parametrize("make_engine", ["tiny", "tiny-moe"], indirect=True)
@pytest.mark.parametrize("through", ["cpu", "disk"])
def test_swapping_between_every_call_follows_the_unswapped_trajectory_bit_for_bit(
    make_engine: Callable[..., Engine], tmp_path: Path, through: str
) -> None:
    ref_engine = make_engine(slots=2)
    ref = AdapterStore(ref_engine, 1 << 30, tmp_path / "ref")  # never swaps: one adapter, two slots
    engine = make_engine(slots=2)
    store = AdapterStore(engine, 1 << 30 if through == "cpu" else 0, tmp_path / "spill")
    ref.create("a", 4, 8.0, seed=3)
    store.create("a", 4, 8.0, seed=3)
    for f in ("f1", "f2"):
        store.create(f, 2, 4.0, seed=9)  # fillers: they take the freed slots, so "a" comes back elsewhere
    slots_seen: set[int] = set()
    fillers = ["f1", "f2"]

    def swap_out_and_in(k: int) -> None:
        store.ensure_resident(["a"])
        store.evict("a")
        assert store.tier_of("a") == through
        if through == "disk":
            assert store.spill_path("a").exists() and store.host_bytes == 0
        store.ensure_resident([fillers[k % 2]])  # occupies a free slot (the lowest: maybe the one "a" left)
        (record,) = store.ensure_resident(["a"])
        assert store.tier_of("a") == "gpu" and not store.spill_path("a").exists()
        slots_seen.add(record.slot)

    k = 0
    for step in range(5):
        batch = [("a", data(step), "cross_entropy", None, False)]
        swap_out_and_in(k := k + 1)
        got, want = (
            engine.forward_backward([engine.prepare(*with_datums(it)) for it in batch])[0],
            ref_engine.forward_backward([ref_engine.prepare(*with_datums(it)) for it in batch])[0],
        )
        assert got == want  # losses and every token's logprob identical
        assert same_state(store.peek("a"), ref.peek("a"))  # unconsumed gradients included
        swap_out_and_in(k := k + 1)  # between forward_backward and optim_step
        assert store.peek("a").rows[1].abs().sum() > 0  # the pending gradient travelled with it
        assert engine.optim_step([("a", ADAM)]) == ref_engine.optim_step([("a", ADAM)])
        for name, (wa, wb) in engine.adapter_weights("a").items():
            ra, rb = ref_engine.adapter_weights("a")[name]
            assert torch.equal(wa, ra) and torch.equal(wb, rb)
        assert same_state(store.peek("a"), ref.peek("a"))
    assert len(slots_seen) == 2  # it came back into both slots
    assert ref.peek("a").step == 5


def test_lru_eviction_order_and_touch(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    store = AdapterStore(make_engine(slots=2), 1 << 30, tmp_path)
    store.create("a", 2, 4.0, 1)
    store.create("b", 2, 4.0, 2)
    store.touch("a")  # b is now the least recently used
    store.create("c", 2, 4.0, 3)
    assert [store.tier_of(m) for m in "abc"] == ["gpu", "cpu", "gpu"]
    assert store.lru_order() == ["b", "a", "c"]
    store.ensure_resident(["b"])  # evicts a (LRU among the resident ones)
    assert [store.tier_of(m) for m in "abc"] == ["cpu", "gpu", "gpu"]
    store.ensure_resident(["c", "a"])  # b is evicted, c and a stay or come in
    assert [store.tier_of(m) for m in "abc"] == ["gpu", "cpu", "gpu"]
    assert store.lru_order() == ["b", "c", "a"]
    with pytest.raises(NotFoundError):
        store.touch("nope")


def test_host_budget_spills_the_least_recently_used_to_disk(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    engine = make_engine(slots=1)
    one = 4 * engine.optimizer.data.shape[1] * 4  # bytes of one slot image
    store = AdapterStore(engine, 2 * one, tmp_path)
    for i in range(5):
        store.create(f"m{i}", 2, 4.0, i)
        assert store.host_bytes <= 2 * one
    assert [store.tier_of(f"m{i}") for i in range(5)] == ["disk", "disk", "cpu", "cpu", "gpu"]
    assert sorted(os.listdir(tmp_path)) == sorted(store.spill_path(f"m{i}").name for i in (0, 1))
    assert store.host_bytes <= 2 * one


def test_host_buffers_are_recycled_not_allocated_per_swap(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    store = AdapterStore(make_engine(slots=1), 1 << 30, tmp_path)
    store.create("a", 2, 4.0, 0)
    store.create("b", 2, 4.0, 0)
    first = store._host["a"].rows
    store.ensure_resident(["a"])  # b out (a second buffer), a in: its buffer goes to the free list
    second = store._host["b"].rows
    for _ in range(3):
        store.ensure_resident(["b"])
        assert store._host["a"].rows is first
        store.ensure_resident(["a"])
        assert store._host["b"].rows is second
    assert len(store._spare) == 1


def test_delete_from_every_tier_removes_it_and_its_file(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    engine = make_engine(slots=1)
    one = 4 * engine.optimizer.data.shape[1] * 4
    store = AdapterStore(engine, one, tmp_path)
    for m in ("d", "c", "g"):
        store.create(m, 2, 4.0, 0)
    assert [store.tier_of(m) for m in ("d", "c", "g")] == ["disk", "cpu", "gpu"]
    store.drain_changes()
    path = store.spill_path("d")
    assert path.exists()
    for m in ("d", "c", "g"):
        store.delete(m)
        with pytest.raises(NotFoundError):
            store.tier_of(m)
    assert not path.exists() and os.listdir(tmp_path) == []
    assert store.host_bytes == 0 and engine.free_slots == 1 and len(store) == 0
    assert store.drain_changes() == [TierChange(m, None) for m in ("d", "c", "g")]
    with pytest.raises(NotFoundError):
        store.delete("d")
    store.create("d", 2, 4.0, 0)  # the id can be reused; it starts from its seed
    assert store.peek("d").rows[1:].abs().sum() == 0


def test_capacity_unknown_and_conflict_errors(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    store = AdapterStore(make_engine(slots=2), 0, tmp_path)
    for m in "abc":
        store.create(m, 2, 4.0, 0)
    with pytest.raises(CapacityError):
        store.ensure_resident(["a", "b", "c"])
    with pytest.raises(NotFoundError):
        store.ensure_resident(["a", "ghost"])
    with pytest.raises(ConflictError):
        store.create("a", 2, 4.0, 0)  # on disk: still exists
    assert store.tier_of("a") == "disk"
    store.ensure_resident(["a", "a", "b"])  # duplicates count once
    assert {store.tier_of(m) for m in "ab"} == {"gpu"}


def test_drain_changes_reports_the_latest_tier_of_each_moved_adapter(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = make_engine(slots=2)
    one = 4 * engine.optimizer.data.shape[1] * 4
    store = AdapterStore(engine, one, tmp_path)
    store.create("a", 2, 4.0, 0)
    store.create("b", 2, 4.0, 0)
    store.create("c", 2, 4.0, 0)  # a -> cpu
    assert store.drain_changes() == [TierChange("b", "gpu", 1), TierChange("a", "cpu"), TierChange("c", "gpu", 0)]
    assert store.drain_changes() == []
    store.create("d", 2, 4.0, 0)  # b -> cpu, over budget: a -> disk
    changes = store.drain_changes()
    assert changes == [
        TierChange("b", "cpu"),
        TierChange("a", "disk", location=str(store.spill_path("a"))),
        TierChange("d", "gpu", 1),
    ]
    store.ensure_resident(["a"])  # c (LRU resident) -> cpu, over budget: b -> disk; a from disk into c's slot
    assert store.drain_changes() == [
        TierChange("c", "cpu"),
        TierChange("b", "disk", location=str(store.spill_path("b"))),
        TierChange("a", "gpu", 0),
    ]


def test_spill_file_is_safetensors_with_its_metadata_and_recovered_by_a_new_store(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    engine = make_engine(slots=1)
    store = AdapterStore(engine, 0, tmp_path)
    store.create("tenant:train:0", 3, 6.0, 11)
    engine.forward_backward([engine.prepare("tenant:train:0", datums(data(0)), "cross_entropy", None, False)])
    engine.optim_step([("tenant:train:0", ADAM)])
    before = store.peek("tenant:train:0")
    store.create("other", 2, 4.0, 0)
    path = store.spill_path("tenant:train:0")
    assert path.parent == tmp_path and ":" not in path.name
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_tensor("rows"), before.rows)
    assert meta["model_id"] == "tenant:train:0" and meta["rank"] == "3" and float(meta["alpha"]) == 6.0
    assert meta["seed"] == "11" and meta["step"] == "1" and "max_rank" in meta["signature"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    # A restarted pool adopts the files on disk: exactly the state they had when spilled.
    (tmp_path / f"{path.name}.tmp123").write_bytes(b"half-written")
    fresh = AdapterStore(make_engine(slots=1), 0, tmp_path, recover=True)
    assert fresh.tier_of("tenant:train:0") == "disk" and "other" not in fresh
    assert not (tmp_path / f"{path.name}.tmp123").exists()
    (record,) = fresh.ensure_resident(["tenant:train:0"])
    assert (record.rank, record.alpha, record.seed) == (3, 6.0, 11)
    assert same_state(fresh.peek("tenant:train:0"), before)
    # By default (the pool's choice) a new store starts empty and removes what a previous run left.
    fresh.evict("tenant:train:0")
    (tmp_path / "notes.txt").write_text("not ours")
    empty = AdapterStore(make_engine(slots=1), 0, tmp_path)
    assert len(empty) == 0 and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_adapters_made_on_the_engine_directly_are_adopted(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    engine = make_engine(slots=2)
    store = AdapterStore(engine, 1 << 30, tmp_path)
    engine.create_adapter("direct", 2, 4.0, 0)
    assert store.tier_of("direct") == "gpu"
    store.create("a", 2, 4.0, 0)
    store.create("b", 2, 4.0, 0)  # "direct" is the LRU one
    assert store.tier_of("direct") == "cpu"
    engine.delete_adapter("a")
    assert "a" not in store
    assert TierChange("a", None) in store.drain_changes()


def req(rid: str, model_id: str, kind: RequestKind, **payload) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


def test_executor_goes_through_the_store(make_engine: Callable[..., Engine], tmp_path: Path) -> None:
    engine = make_engine(slots=2)
    store = AdapterStore(engine, 0, tmp_path)
    executor = PlanExecutor(engine, store)
    names = ["a", "b", "c"]
    creates = Step(StepKind.CREATE, tuple(req(f"c{m}", m, RequestKind.CREATE_ADAPTER, rank=2, seed=1) for m in names))
    fb = Step(
        StepKind.FORWARD_BACKWARD,
        tuple(req(f"f{m}", m, RequestKind.FORWARD_BACKWARD, data=data(0)) for m in [*names, "ghost"]),
    )
    opt = Step(StepKind.OPTIM_STEP, tuple(req(f"o{m}", m, RequestKind.OPTIM_STEP, adam_params=ADAM) for m in names))
    deletes = Step(StepKind.DELETE, (req("db", "b", RequestKind.DELETE_ADAPTER),))
    outcomes = {o.request_id: o for o in executor.execute(BatchPlan((creates, fb, opt, deletes)))}
    # Three adapters on two slots: the step runs in parts that fit (the policy normally keeps steps within the slots).
    assert all(outcomes[k].ok for k in ("ca", "cb", "cc", "fa", "fb", "fc", "oa", "ob", "oc", "db"))
    assert outcomes["fghost"].error_name == "NotFoundError"
    assert outcomes["fa"].result == outcomes["fb"].result == outcomes["fc"].result  # same seed, same data
    assert "b" not in store and not store.spill_path("b").exists()
    # a trained beside b (a two-group batch), c alone (the one-adapter matmul path): equal up to fp32 rounding, which
    # depends on the kernel (bit-equal on some CPUs, 4e-9 apart on others).
    a, c = store.peek("a"), store.peek("c")
    assert torch.allclose(a.rows, c.rows, rtol=0, atol=1e-7) and (a.step, a.rank, a.seed) == (c.step, c.rank, c.seed)
    assert store.peek("a").step == 1
