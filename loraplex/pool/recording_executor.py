"""The pool's executor as the dispatcher sees it: the engine's executor, timed per plan (usage seconds, for the
OutcomeRecorder), with a `checkpoints` row added for each successful save BEFORE the loop stores the results, so a
client that sees a save's result can load it at once. (A crash before the result is stored redelivers the save: it
runs again, rewrites its files and replaces the row.) A save whose row cannot be written fails. The database away
(stopped, crashed, restarting) is no reason to fail it: the rows' transaction is run again until the database is back
(storage/outage.retry_database, up to DATABASE_OUTAGE_S; replacing a row is idempotent), the save failing only
after that. With a lease, the rows' transaction is fenced like the OutcomeRecorder's (dispatch/records.check_leader):
a deposed leader writes no row, and its plan fails with LeaseLostError.

A save whose files are still being written in the background (`BackgroundWrites`: a sampler save copies the weights
in the plan and writes beside the next plans) gets its row in `settle`, which the finisher runs before it records
and publishes the plan (the pool's `on_outcomes`): it waits for the write, adds its size and hash to the result, then
writes the row; a failed write fails the save."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import timedelta

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import LoraplexError
from loraplex.pool.records import PlanNotes, TierChanges, check_leader
from loraplex.protocol import (
    KINDS,
    SAVE_KINDS,
    BatchPlan,
    Executor,
    Outcome,
    PlannedRequest,
    RequestKind,
    SaveCheckpointPayload,
)
from loraplex.protocol.checkpoint_paths import CheckpointKind
from loraplex.queue.lease import PoolLease
from loraplex.runtime.background_writes import BackgroundWrites
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.storage.db import database_unavailable
from loraplex.storage.outage import retry_database
from loraplex.storage.repositories import CheckpointRepository, unit_of_work
from loraplex.storage.types import utcnow

log = logging.getLogger(__name__)


class RecordingExecutor:
    def __init__(
        self,
        executor: Executor,
        sessions: sessionmaker[Session],
        notes: PlanNotes,
        store: TierChanges | None = None,
        *,
        pool: str = "",
        lease: PoolLease | None = None,
        writes: BackgroundWrites | None = None,
    ) -> None:
        """store: the rank-0 adapter store, drained here right after each plan (the thread that moves adapters);
        lease: fence the checkpoint rows with this lease's token (the pools row of `pool` must hold it); writes: the
        executor's background file writes (see the module doc)."""
        self._writes = writes
        self._pool = pool
        self._lease = lease
        self._executor = executor
        self._sessions = sessions
        self._notes = notes
        self._store = store
        self._warn = RateLimitedLog(log, every_s=5.0)

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        started = time.monotonic()
        try:
            outcomes = self._executor.execute(plan)
        finally:
            changes = self._store.drain_changes() if self._store is not None else ()
            self._notes.put(plan, time.monotonic() - started, changes)
        return self.record_checkpoints(outcomes, plan)

    def record_checkpoints(self, outcomes: list[Outcome], plan: BatchPlan) -> list[Outcome]:
        """Add the `checkpoints` rows of the plan's successful saves (see the module doc); failed rows fail their save.
        Saves still writing their files are left to `settle`."""
        saves = [r for r in plan.requests if r.kind in SAVE_KINDS and not self._writing(r)]
        return self._record(outcomes, saves)

    def _writing(self, request: PlannedRequest) -> bool:
        return self._writes is not None and self._writes.pending(request.request_id)

    def settle(self, outcomes: list[Outcome], plan: BatchPlan) -> list[Outcome]:
        """The finisher's part: wait for the plan's background writes, complete their results and record their rows."""
        writing = [r for r in plan.requests if r.kind in SAVE_KINDS and self._writing(r)]
        if not writing or self._writes is None:
            return outcomes
        settled: dict[str, Outcome] = {}
        by_id = {o.request_id: o for o in outcomes}
        for request in writing:
            outcome = by_id.get(request.request_id)
            try:
                files = self._writes.take(request.request_id)
            except Exception as exc:  # noqa: BLE001 - any failure to write is this save's error
                log.exception("writing the checkpoint of %s (request %s) failed", request.model_id, request.request_id)
                typed = type(exc).__name__ if isinstance(exc, LoraplexError) else "EngineError"
                settled[request.request_id] = Outcome(
                    request.request_id, error_type=typed, error=f"writing the checkpoint failed: {exc}"
                )
                continue
            if outcome is not None and outcome.ok:
                settled[request.request_id] = replace(outcome, result={**(outcome.result or {}), **files})
        outcomes = [settled.get(o.request_id, o) for o in outcomes]
        return self._record(outcomes, [r for r in writing if settled.get(r.request_id, Outcome(r.request_id)).ok])

    def _record(self, outcomes: list[Outcome], saves: list[PlannedRequest]) -> list[Outcome]:
        if not saves:
            return outcomes
        by_id = {o.request_id: o for o in outcomes}
        failed: dict[str, Outcome] = {}

        def fail(request: PlannedRequest, exc: Exception) -> None:
            log.exception("checkpoint of %s (request %s) not recorded", request.model_id, request.request_id)
            failed[request.request_id] = Outcome(
                request.request_id, error_type="EngineError", error=f"checkpoint saved but not recorded: {exc}"
            )

        done = [r for r in saves if (o := by_id.get(r.request_id)) is not None and o.ok and o.result]

        def write() -> None:
            failed.clear()  # a retry starts over: the rolled-back attempt wrote nothing
            with unit_of_work(self._sessions) as session:
                check_leader(session, self._pool, self._lease)  # LeaseLostError: the plan fails, nothing written
                for request in done:
                    try:  # one row that cannot be written must not cost the others
                        with session.begin_nested():
                            _record_checkpoint(
                                session, request, _checkpoint_kind(request.kind), by_id[request.request_id].result or {}
                            )
                    except (LoraplexError, SQLAlchemyError) as exc:
                        if database_unavailable(exc):
                            raise  # not this row's fault: the whole transaction again
                        fail(request, exc)

        try:
            retry_database(write, "recording checkpoint rows", self._warn)
        except SQLAlchemyError as exc:  # the transaction itself failed: none of the rows is there
            for request in done:
                fail(request, exc)
        return [failed.get(o.request_id, o) for o in outcomes]


def _record_checkpoint(session: Session, request: PlannedRequest, kind: CheckpointKind, result: dict) -> None:
    """The row of a save the worker finished. The gateway put the name, folder URI and ttl in the payload; the files
    now on disk are this save's, so a row of the same name (an overwrite, or a racing save) is replaced."""
    p = request.payload
    assert isinstance(p, SaveCheckpointPayload)
    ttl = p.ttl_seconds
    CheckpointRepository(session, request.tenant_id).add(
        request.model_id,
        kind,
        str(p.name),
        str(p.blob_uri),
        int(result.get("size_bytes", 0)),
        str(result.get("sha256", "")),
        step=int(result.get("step", 0)),
        expires_at=utcnow() + timedelta(seconds=float(ttl)) if ttl else None,
        include_deleted=True,
        replace=True,
    )


def _checkpoint_kind(kind: RequestKind) -> CheckpointKind:
    """The checkpoints row's kind of a save request (protocol's table says which kinds save, and what)."""
    saves = KINDS[kind].saves
    assert saves is not None, f"{kind} saves no checkpoint"
    return saves
