"""The end of a plan in the pool (pool/finish.py) on the real engine and adapter store (tiny model, CPU), real SQLite
and a real redis-server: a plan that trains and saves (one save written in the plan, a sampler save written in the
background) costs exactly one SQL transaction between the engine's end and its results, and that transaction holds
everything the plan changed (checkpoint rows, applied seq_ids, usage, residency). With the request log on, a sampler
save is answered before its files are written (its row pending, settled once they are there; deleted meanwhile, they
go); the writer is held by the hook the pool takes from `test_hold_writes_file`, so the order is observed, not timed."""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select

from loraplex.dispatch.hooks import AnsweredPlan
from loraplex.pool.finish import PlanFinish
from loraplex.pool.process import engine_spec, store_spec
from loraplex.protocol import (
    BatchPlan,
    CreateAdapterPayload,
    DatumPayload,
    ForwardBackwardPayload,
    OptimStepPayload,
    Outcome,
    PlannedRequest,
    RequestKind,
    SaveCheckpointPayload,
    Step,
    StepKind,
)
from loraplex.protocol.results import SaveResult
from loraplex.runtime.background_writes import BackgroundWrites
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, migrate, session_factory
from loraplex.storage.models import AdapterStatus, Checkpoint, Residency, Usage
from loraplex.storage.repositories import AdapterRepository, TenantRepository, unit_of_work
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.ranks.rank_loop import build_rank_engine


class Transactions:
    """Counts the transactions begun and committed on a real SQLAlchemy engine (its connection events)."""

    def __init__(self, engine: Any) -> None:
        self.begun = 0
        self.committed = 0
        event.listen(engine, "begin", self._begin)
        event.listen(engine, "commit", self._commit)

    def _begin(self, conn: Any) -> None:
        self.begun += 1

    def _commit(self, conn: Any) -> None:
        self.committed += 1


@pytest.fixture
def pool_world(tiny_dir: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = make_db_engine(url)
    sessions = session_factory(db)
    with unit_of_work(sessions) as session:
        tenant, _ = TenantRepository(session).create_tenant("t")
        AdapterRepository(session, tenant.id).create("a", "tiny", 4, 8.0, ["q_proj"], 3)
    settings = Settings(home=tmp_path, base_model="tiny", model_cache=tiny_dir.parent, device="cpu", slots=2,
                        max_rank=4, pool_cpu_threads=1)  # fmt: skip
    engine = build_rank_engine(engine_spec(settings), None)
    store = store_spec(settings).build(engine, 0)
    writes = BackgroundWrites()
    try:
        yield {"db": db, "sessions": sessions, "tenant": tenant.id, "store": store, "writes": writes,
               "executor": PlanExecutor(engine, store, None, writes), "blobs": tmp_path / "blobs",
               "pool": f"finish-{uuid.uuid4().hex[:8]}"}  # fmt: skip
    finally:
        writes.close()
        db.dispose()


def _request(tenant: str, seq: int, kind: RequestKind, payload: Any) -> PlannedRequest:
    return PlannedRequest(uuid.uuid4().hex, tenant, "a", seq, kind, payload)


def _save(w: dict[str, Any], seq: int, kind: RequestKind, name: str) -> PlannedRequest:
    folder = w["blobs"] / name
    p = SaveCheckpointPayload(name=name, path=f"tinker://a/{name}", directory=str(folder), blob_uri=folder.as_uri(),
                              base_model="tiny")  # fmt: skip
    return _request(w["tenant"], seq, kind, p)


def _train_and_save(w: dict[str, Any]) -> BatchPlan:
    toks = list(range(1, 10))
    datum = DatumPayload(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 8})
    t = w["tenant"]
    return BatchPlan((
        Step(StepKind.FORWARD_BACKWARD, (_request(t, 1, RequestKind.FORWARD_BACKWARD,
                                                  ForwardBackwardPayload(data=(datum,))),)),
        Step(StepKind.OPTIM_STEP, (_request(t, 2, RequestKind.OPTIM_STEP,
                                            OptimStepPayload(adam_params={"learning_rate": 1e-3})),)),
        Step(StepKind.CHECKPOINT, (_save(w, 3, RequestKind.SAVE_STATE, "state-1"),)),
        Step(StepKind.CHECKPOINT, (_save(w, 4, RequestKind.SAVE_SAMPLER, "sampler-1"),)),
    ))  # fmt: skip


def _created(w: dict[str, Any]) -> None:
    create = _request(w["tenant"], 0, RequestKind.CREATE_ADAPTER, CreateAdapterPayload(base_model="tiny", rank=4, seed=3))
    (outcome,) = w["executor"].execute(BatchPlan((Step(StepKind.CREATE, (create,)),)))
    assert outcome.ok
    with unit_of_work(w["sessions"]) as session:
        AdapterRepository(session, w["tenant"]).set_status("a", AdapterStatus.READY)


def test_a_plan_with_saves_is_recorded_in_one_transaction(pool_world: dict[str, Any]) -> None:
    w = pool_world
    _created(w)
    plan = _train_and_save(w)
    finish = PlanFinish(w["sessions"], pool=w["pool"], store=w["store"], writes=w["writes"])
    stored: list[list[Outcome]] = []
    acked: list[bool] = []
    counted = Transactions(w["db"])
    outcomes = w["executor"].execute(plan)  # the engine's part writes no SQL
    assert (counted.begun, counted.committed) == (0, 0)
    tier_moves = finish.on_loop(plan)
    assert tier_moves  # the adapter went in and out of its slot: the residency rows are this plan's too

    def publish(shown: list[Outcome]) -> None:
        assert (counted.begun, counted.committed) == (1, 1)  # the plan's record first
        stored.append(shown)

    finish(AnsweredPlan(plan, outcomes, 0.25, tier_moves, publish, lambda: acked.append(bool(stored))))
    transactions = (counted.begun, counted.committed)
    outcomes = stored[0]
    assert acked == [True]  # acked after the results were stored
    print(f"SQL transactions for one plan with saves: {transactions[0]} begun, {transactions[1]} committed")
    assert all(o.ok for o in outcomes), outcomes
    with w["sessions"]() as session:
        assert session.scalar(select(func.count()).select_from(Checkpoint)) == 2
        assert session.scalar(select(func.count()).select_from(Usage)) == 1
        assert AdapterRepository(session, w["tenant"]).get("a").applied_seq_id == 4
        (usage,) = session.scalars(select(Usage)).all()
        assert usage.seconds == pytest.approx(0.25)
        assert session.scalar(select(func.count()).select_from(Residency)) >= 1
    sampler = next(o for o in outcomes if o.request_id == plan.steps[3].requests[0].request_id)
    assert isinstance(sampler.result, SaveResult) and sampler.result.sha256  # its background write, completed
    assert transactions == (1, 1)


def _held_world(w: dict[str, Any]) -> tuple[BackgroundWrites, threading.Event]:
    """The pool's writer held until the event is set (the hook the pool takes from `test_hold_writes_file`)."""
    release = threading.Event()
    writes = BackgroundWrites(lambda: release.wait(60))
    w["executor"].writes = writes
    return writes, release


def _checkpoint_row(w: dict[str, Any], name: str) -> Checkpoint | None:
    with w["sessions"]() as session:
        return session.scalar(select(Checkpoint).where(Checkpoint.name == name))


def test_with_the_request_log_a_sampler_save_is_answered_before_its_files_and_settled_after(
    pool_world: dict[str, Any],
) -> None:
    w = pool_world
    _created(w)
    writes, release = _held_world(w)
    finish = PlanFinish(w["sessions"], pool=w["pool"], store=w["store"], writes=writes, answer_before_files=True)
    plan = _train_and_save(w)
    seen: list[tuple[Checkpoint | None, bool]] = []
    stored: list[list[Outcome]] = []

    def publish(shown: list[Outcome]) -> None:  # the answer: its row is there, its files are not
        seen.append((_checkpoint_row(w, "sampler-1"), (w["blobs"] / "sampler-1").exists()))
        stored.append(shown)

    try:
        outcomes = w["executor"].execute(plan)
        finish(AnsweredPlan(plan, outcomes, 0.1, finish.on_loop(plan), publish, lambda: None))
        ((row, exists),) = seen
        assert row is not None and row.sha256 == "" and not exists  # answered before the files, row pending
        sampler = next(o for o in stored[0] if o.request_id == plan.steps[3].requests[0].request_id)
        assert sampler.ok and isinstance(sampler.result, SaveResult) and sampler.result.sha256 is None
        assert "sampler-1" in [c.name for c in _checkpoints_out(w)]  # listed while pending, size None
        assert next(c for c in _checkpoints_out(w) if c.name == "sampler-1").size_bytes is None
        barrier = writes.barrier()
        assert not barrier.done()  # a snapshot recorded now would wait for the files
    finally:
        release.set()
    barrier.result(timeout=60)  # done only after the write and its row's settling
    row = _checkpoint_row(w, "sampler-1")
    manifest = (w["blobs"] / "sampler-1" / "checkpoint.json").read_bytes()
    assert row is not None and row.sha256 == hashlib.sha256(manifest).hexdigest()
    assert row.size_bytes == sum(f.stat().st_size for f in (w["blobs"] / "sampler-1").iterdir())
    writes.close()


def test_a_pending_save_deleted_before_its_files_leaves_none(pool_world: dict[str, Any]) -> None:
    w = pool_world
    _created(w)
    writes, release = _held_world(w)
    finish = PlanFinish(w["sessions"], pool=w["pool"], store=w["store"], writes=writes, answer_before_files=True)
    plan = _train_and_save(w)
    try:
        outcomes = w["executor"].execute(plan)
        finish(AnsweredPlan(plan, outcomes, 0.1, finish.on_loop(plan), lambda shown: None, lambda: None))
        with unit_of_work(w["sessions"]) as session:
            row = session.scalar(select(Checkpoint).where(Checkpoint.name == "sampler-1"))
            assert row is not None and row.sha256 == ""
            session.delete(row)  # the tenant deletes it while its files are being written
    finally:
        release.set()
    writes.barrier().result(timeout=60)
    assert not (w["blobs"] / "sampler-1").exists()  # written, then removed: no row names it
    assert (w["blobs"] / "state-1").exists()
    writes.close()


def _checkpoints_out(w: dict[str, Any]) -> list[Any]:
    from loraplex.service.checkpoints import checkpoint_out

    with w["sessions"]() as session:
        return [checkpoint_out(c) for c in session.scalars(select(Checkpoint))]
