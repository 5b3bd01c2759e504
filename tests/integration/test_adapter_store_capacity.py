"""Capacity: 1,000 adapters on one tiny-model CPU pool with 4 resident slots and a host budget of a
few snapshots, so almost all of them live on disk; each is trained one forward_backward + optim_step in turn through
the PlanExecutor (plans of 4 adapters). Every adapter ends bit-identical to a never-swapped reference, the host tier
never exceeds its budget, and the spill folder holds exactly the disk tier's files. Prints the swap time per adapter."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from loraplex.models import load_base_model, resolve
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.state.adapter_store import AdapterStore

pytestmark = [pytest.mark.timeout(240)]

ADAPTERS = 1000
SLOTS = 4
RANK = 2
ADAM = {"learning_rate": 1e-2, "weight_decay": 0.01}
DATA = [{"model_input": [5, 17, 99, 3, 42, 7], "loss_fn_inputs": {"target_tokens": [17, 99, 3, 42, 7, 8]}}]


def req(rid: str, model_id: str, kind: RequestKind, seq: int = 0, **payload) -> PlannedRequest:
    return PlannedRequest(rid, "tenant", model_id, seq, kind, payload)


def creates(ids: list[str]) -> BatchPlan:
    step = Step(StepKind.CREATE, tuple(req(f"c-{m}", m, RequestKind.CREATE_ADAPTER, rank=RANK, seed=7) for m in ids))
    return BatchPlan((step,))


def train(ids: list[str]) -> BatchPlan:
    fb = Step(
        StepKind.FORWARD_BACKWARD, tuple(req(f"f-{m}", m, RequestKind.FORWARD_BACKWARD, 1, data=DATA) for m in ids)
    )
    opt = Step(StepKind.OPTIM_STEP, tuple(req(f"o-{m}", m, RequestKind.OPTIM_STEP, 2, adam_params=ADAM) for m in ids))
    return BatchPlan((fb, opt))


def make_engine(tiny_dir: Path) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(num_slots=SLOTS, max_rank=RANK))


def test_a_thousand_adapters_on_four_slots_train_exactly_within_the_host_budget(tmp_path: Path) -> None:
    tiny_dir = resolve("tiny", tmp_path / "model-cache")
    # The reference: four adapters trained once in one plan, never swapped.
    ref_engine = make_engine(tiny_dir)
    ref_store = AdapterStore(ref_engine, 1 << 30, tmp_path / "ref")
    ref = PlanExecutor(ref_engine, ref_store)
    ref_ids = [f"ref{k}" for k in range(SLOTS)]
    assert all(o.ok for o in ref.execute(creates(ref_ids)))
    ref_out = {o.request_id: o for o in ref.execute(train(ref_ids))}
    ref_state = [ref_store.peek(m) for m in ref_ids]

    engine = make_engine(tiny_dir)
    one = 4 * engine.optimizer.data.shape[1] * 4  # bytes of one adapter's state (64 KiB here)
    budget = 16 * one  # 1 MiB: 16 adapters in host memory, the rest on disk
    spill = tmp_path / "spill"
    store = AdapterStore(engine, budget, spill)
    executor = PlanExecutor(engine, store)
    ids = [f"tenant{i % 7}:adapter-{i}" for i in range(ADAPTERS)]

    started = time.perf_counter()
    for start in range(0, ADAPTERS, 50):
        assert all(o.ok for o in executor.execute(creates(ids[start : start + 50])))
        assert store.host_bytes <= budget
    created_s = time.perf_counter() - started
    assert len(store) == ADAPTERS and len(list(spill.iterdir())) == ADAPTERS - SLOTS - 16

    started = time.perf_counter()
    for start in range(0, ADAPTERS, SLOTS):
        group = ids[start : start + SLOTS]
        out = {o.request_id: o for o in executor.execute(train(group))}
        assert store.host_bytes <= budget
        for k, m in enumerate(group):  # position k in the plan: the same rows as reference k
            assert out[f"f-{m}"].result == ref_out[f"f-ref{k}"].result
            assert out[f"o-{m}"].result == ref_out[f"o-ref{k}"].result
    trained_s = time.perf_counter() - started

    tiers = {m: store.tier_of(m) for m in ids}
    assert sum(t == "gpu" for t in tiers.values()) == SLOTS
    assert sum(t == "cpu" for t in tiers.values()) == 16
    on_disk = {store.spill_path(m).name for m, t in tiers.items() if t == "disk"}
    assert {p.name for p in spill.iterdir()} == on_disk and len(on_disk) == ADAPTERS - SLOTS - 16
    for i, m in enumerate(ids):  # every adapter's whole state (weights, Adam moments, step) equals its reference's
        state, want = store.peek(m), ref_state[i % SLOTS]
        assert state.step == want.step == 1
        assert torch.equal(state.rows, want.rows), m

    s = store.stats
    ms = 1e3
    print(
        f"\n{ADAPTERS} adapters, {SLOTS} slots, {one // 1024} KiB per adapter state, host budget {budget // 1024} KiB: "
        f"create {created_s:.1f} s, train {trained_s:.1f} s\n"
        f"  slot -> host  {s.out_host_s / max(s.out_host, 1) * ms:.3f} ms/adapter ({s.out_host})\n"
        f"  host -> slot  {s.in_host_s / max(s.in_host, 1) * ms:.3f} ms/adapter ({s.in_host})\n"
        f"  host -> disk  {s.spill_s / max(s.spills, 1) * ms:.3f} ms/adapter ({s.spills}, fsync'd)\n"
        f"  disk -> slot  {s.in_disk_s / max(s.in_disk, 1) * ms:.3f} ms/adapter ({s.in_disk})"
    )
    assert s.in_disk >= ADAPTERS - SLOTS - 16
