"""The snapshot writer and recovery (loraplex/durable/) on a real engine and adapter store (tiny model, fp32), real
SQLite and a real redis-server; driven plan by plan through `after_plan` as the dispatcher does, with a stand-in for
the loop's progress it is handed (its applied seq_ids, requests in parts, and the finisher's order).

- a snapshot's row appears only after the results of the plans it covers are stored (the finisher's release);
- disk full while a snapshot is written (the one fault injected by a monkeypatch: the real atomic write, whose file
  raises ENOSPC half-way) leaves no file behind, no row, and the previous snapshot loadable; a restart adopts it; the
  next write succeeds;
- a corrupt file is refused by its hash check, and recovery falls back to the version before it.
"""

from __future__ import annotations

import contextlib
import errno
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.dispatch.hooks import LoopProgress
from loraplex.errors import CorruptSnapshotError
from loraplex.models import load_base_model
from loraplex.pool.durable.recovery import recover_pool
from loraplex.pool.durable.snapshotter import Snapshotter
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.storage.db import make_db_engine, migrate, session_factory
from loraplex.storage.models import AdapterStatus
from loraplex.storage.repositories import AdapterRepository, SnapshotRepository, TenantRepository, unit_of_work
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.state import spill_format
from loraplex.workers.state.adapter_store import AdapterStore
from loraplex.workers.state.durable_snapshot import read_durable_snapshot
from tests.helpers.datums import datums

ADAM = {"learning_rate": 2e-2}


class Finisher:
    """The loop's progress as the snapshotter is handed it: applied seq_ids, adapters in parts (none), and jobs run
    in finisher order (held until `finish()`, as a finisher still storing results would)."""

    def __init__(self) -> None:
        self.applied: dict[str, int | None] = {}
        self.held: list[Callable[[], None]] = []

    @property
    def progress(self) -> LoopProgress:
        return LoopProgress(self.applied, frozenset(), self.after_finished)

    def after_finished(self, job: Callable[[], None]) -> None:
        self.held.append(job)

    def finish(self) -> None:
        jobs, self.held = self.held, []
        for job in jobs:
            job()


@pytest.fixture
def world(tiny_dir: Path, tmp_path: Path, redis_client: Any) -> Iterator[dict[str, Any]]:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    sessions = session_factory(make_db_engine(url))
    with unit_of_work(sessions) as session:
        tenant, _ = TenantRepository(session).create_tenant("t")
        AdapterRepository(session, tenant.id).create("a", "tiny", 4, 8.0, ["q_proj"], 3)
        AdapterRepository(session, tenant.id).set_status("a", AdapterStatus.READY)

    def engine() -> Engine:
        model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
        return build_engine(model, EngineConfig(num_slots=2, max_rank=4))

    yield {"sessions": sessions, "tenant": tenant.id, "engine": engine, "blobs": tmp_path / "blobs",
           "pool": f"p-{uuid.uuid4().hex[:8]}", "redis": redis_client, "spill": tmp_path / "spill"}  # fmt: skip


def _step(engine: Engine, k: int) -> None:
    toks = [(k * 13 + j * 5) % 400 + 1 for j in range(9)]
    item = engine.prepare("a", datums([{"model_input": toks[:-1], "loss_fn_inputs": {"target_tokens": toks[1:],
                                 "weights": [1.0] * 8}}]), "cross_entropy", None, False)  # fmt: skip
    engine.forward_backward([item])
    engine.optim_step([("a", ADAM)])


def _plan(tenant: str, seq: int) -> BatchPlan:
    r = PlannedRequest(uuid.uuid4().hex, tenant, "a", seq, RequestKind.OPTIM_STEP, {"adam_params": ADAM})
    return BatchPlan((Step(StepKind.OPTIM_STEP, (r,)),))


def _rows(w: dict[str, Any]) -> list:
    with w["sessions"]() as session:
        return SnapshotRepository(session).newest_first("a")


def _wait(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_disk_full_during_a_snapshot_keeps_the_previous_one_usable(world: dict[str, Any], monkeypatch) -> None:
    w = world
    engine = w["engine"]()
    store = AdapterStore(engine, 1 << 30, w["spill"])
    store.create("a", 4, 8.0, 3)
    snaps = Snapshotter(store, w["sessions"], w["redis"], pool=w["pool"], blob_root=w["blobs"], every_steps=1,
                        every_s=0)  # fmt: skip
    fin = Finisher()
    try:
        _step(engine, 0)
        fin.applied["a"] = 2
        snaps.after_plan(_plan(w["tenant"], 2), fin.progress)
        time.sleep(0.3)
        assert _rows(w) == []  # written, but its plan's results are not stored yet: no row
        fin.finish()
        _wait(lambda: snaps.written == 1)
        first = store.peek("a").rows.clone()
        (v1,) = _rows(w)
        assert v1.applied_seq_id == 2 and v1.step == 1

        # Disk full: the real atomic write, whose file refuses the bytes past the first 100 with ENOSPC.
        real = spill_format.atomic_write

        @contextlib.contextmanager
        def full_disk(path: Path) -> Iterator[Any]:
            with real(path) as f:
                written = [0]
                write = f.write

                def refuse(data: Any) -> int:
                    written[0] += len(memoryview(data).cast("B"))
                    if written[0] > 100:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return write(data)

                f.write = refuse  # type: ignore[method-assign]
                yield f

        monkeypatch.setattr(spill_format, "atomic_write", full_disk)
        _step(engine, 1)
        fin.applied["a"] = 4
        snaps.after_plan(_plan(w["tenant"], 4), fin.progress)
        fin.finish()
        _wait(lambda: not snaps._in_flight)
        assert snaps.written == 1 and [r.version for r in _rows(w)] == [1]
        folder = Path(v1.path).parent
        assert sorted(p.name for p in folder.iterdir()) == [Path(v1.path).name]  # no partial or temporary file
        snapshot, seq = read_durable_snapshot(Path(v1.path), v1.sha256, store.signature.width)
        assert seq == 2 and torch.equal(snapshot.rows, first)

        # A restart adopts the previous snapshot, bit for bit (no log here: nothing to replay after it).
        fresh = AdapterStore(w["engine"](), 1 << 30, w["spill"] / "again")
        got = recover_pool(pool=w["pool"], store=fresh, executor=PlanExecutor(fresh.engine, fresh),
                           sessions=w["sessions"], redis=w["redis"])  # fmt: skip
        assert [(a.model_id, a.snapshot_version, a.applied_seq_id) for a in got.adopted] == [("a", 1, 2)]
        assert torch.equal(fresh.peek("a").rows, first)

        # Space again: the adapter was still due, and its next snapshot goes through.
        monkeypatch.setattr(spill_format, "atomic_write", real)
        _step(engine, 2)
        fin.applied["a"] = 6
        snaps.after_plan(_plan(w["tenant"], 6), fin.progress)
        fin.finish()
        _wait(lambda: snaps.written == 2)
        assert [(r.version, r.applied_seq_id) for r in _rows(w)] == [(2, 6), (1, 2)]
    finally:
        snaps.close()


def test_a_corrupt_snapshot_is_refused_and_recovery_takes_the_one_before(world: dict[str, Any]) -> None:
    w = world
    engine = w["engine"]()
    store = AdapterStore(engine, 1 << 30, w["spill"])
    store.create("a", 4, 8.0, 3)
    snaps = Snapshotter(store, w["sessions"], w["redis"], pool=w["pool"], blob_root=w["blobs"], every_steps=1,
                        every_s=0)  # fmt: skip
    fin = Finisher()
    states = []
    try:
        for k in range(2):
            _step(engine, k)
            fin.applied["a"] = 2 * k + 2
            snaps.after_plan(_plan(w["tenant"], 2 * k + 2), fin.progress)
            fin.finish()
            _wait(lambda k=k: snaps.written == k + 1)
            states.append(store.peek("a").rows.clone())
    finally:
        snaps.close()
    v2, v1 = _rows(w)
    data = bytearray(Path(v2.path).read_bytes())
    data[-5] ^= 0x01  # one bit of one float
    Path(v2.path).write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match="fails its hash check"):
        read_durable_snapshot(Path(v2.path), v2.sha256, store.signature.width)
    fresh = AdapterStore(w["engine"](), 1 << 30, w["spill"] / "again")
    got = recover_pool(pool=w["pool"], store=fresh, executor=PlanExecutor(fresh.engine, fresh),
                       sessions=w["sessions"], redis=w["redis"])  # fmt: skip
    assert got.skipped_snapshots == [v2.path]
    assert [(a.snapshot_version, a.applied_seq_id) for a in got.adopted] == [(1, 2)]
    assert torch.equal(fresh.peek("a").rows, states[0])



@pytest.mark.parametrize("short", [0, 1], ids=["room-for-one", "under-one-state"])
def test_a_copy_budget_of_one_adapter_takes_due_adapters_one_at_a_time_as_they_were(
    world: dict[str, Any], short: int
) -> None:
    """copy_budget_bytes: with room for one adapter's state, two due adapters are taken one per plan (the other stays
    due, nothing lost); each snapshot holds the state at the plan it was taken after, though training went on before
    the writer copied it. A budget under one state (short) copies it at once instead of cloning it, one per plan too."""
    w = world
    with unit_of_work(w["sessions"]) as session:
        AdapterRepository(session, w["tenant"]).create("b", "tiny", 4, 8.0, ["q_proj"], 5)
        AdapterRepository(session, w["tenant"]).set_status("b", AdapterStatus.READY)
    engine = w["engine"]()
    store = AdapterStore(engine, 1 << 30, w["spill"])
    store.create("a", 4, 8.0, 3)
    store.create("b", 4, 8.0, 5)
    snaps = Snapshotter(store, w["sessions"], w["redis"], pool=w["pool"], blob_root=w["blobs"], every_steps=1,
                        every_s=0, copy_budget_bytes=store.stats.bytes_per_adapter - short)  # fmt: skip
    fin = Finisher()

    def plan(seq: int) -> BatchPlan:
        rs = tuple(PlannedRequest(uuid.uuid4().hex, w["tenant"], m, seq, RequestKind.OPTIM_STEP, {"adam_params": ADAM})
                   for m in ("a", "b"))  # fmt: skip
        return BatchPlan((Step(StepKind.OPTIM_STEP, rs),))

    def rows_of(m: str) -> list:
        with w["sessions"]() as session:
            return SnapshotRepository(session).newest_first(m)

    try:
        _step(engine, 0)
        item = engine.prepare("b", datums([{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4],
                              "weights": [1.0] * 3}}]), "cross_entropy", None, False)  # fmt: skip
        engine.forward_backward([item])
        engine.optim_step([("b", ADAM)])
        fin.applied.update(a=2, b=2)
        snaps.after_plan(plan(2), fin.progress)
        taken = [m for m in ("a", "b") if m in snaps._in_flight]
        assert len(taken) == 1  # the budget: one adapter's state at a time
        (first,) = taken
        other = "b" if first == "a" else "a"
        state = store.peek(first).rows.clone()
        _step(engine, 1)  # "a" trains on before the writer copies
        snaps.after_plan(BatchPlan(()), fin.progress)  # the first still in flight: nothing taken
        assert snaps._in_flight == {first}
        fin.finish()
        _wait(lambda: snaps.written == 1 and not snaps._in_flight)
        (row,) = rows_of(first)
        snapshot, _ = read_durable_snapshot(Path(row.path), row.sha256, store.signature.width)
        assert torch.equal(snapshot.rows, state)
        assert rows_of(other) == []
        snaps.after_plan(BatchPlan(()), fin.progress)  # still due: taken now
        fin.finish()
        _wait(lambda: snaps.written == 2)
        assert len(rows_of(other)) == 1
    finally:
        snaps.close()


def test_an_idle_changed_adapter_is_snapshotted_after_the_time_trigger(world: dict[str, Any]) -> None:
    """every_s: the dispatcher's idle tick (after_plan with an empty plan) writes an adapter that changed and then
    went quiet, once the time has passed; not before."""
    w = world
    engine = w["engine"]()
    store = AdapterStore(engine, 1 << 30, w["spill"])
    store.create("a", 4, 8.0, 3)
    now = [0.0]
    snaps = Snapshotter(store, w["sessions"], w["redis"], pool=w["pool"], blob_root=w["blobs"], every_steps=0,
                        every_s=30.0, clock=lambda: now[0])  # fmt: skip
    fin = Finisher()
    try:
        _step(engine, 0)
        fin.applied["a"] = 2
        snaps.after_plan(_plan(w["tenant"], 2), fin.progress)
        now[0] = 29.0
        snaps.after_plan(BatchPlan(()), fin.progress)
        assert fin.held == []  # not due yet
        now[0] = 31.0
        snaps.after_plan(BatchPlan(()), fin.progress)
        fin.finish()
        _wait(lambda: snaps.written == 1)
        assert [(r.version, r.applied_seq_id) for r in _rows(w)] == [(1, 2)]
        now[0] = 100.0
        snaps.after_plan(BatchPlan(()), fin.progress)
        assert fin.held == []  # unchanged since: nothing to write
    finally:
        snaps.close()
