"""The end of a plan in the pool, after the engine ran it: `PlanFinish`, the dispatcher's finish step
(dispatch/hooks.FinishStep), on the finisher thread, plan after plan in order while the next plan runs:

1. the plan's background writes (a sampler save copies the weights in the plan and writes its files beside the next
   plans, runtime/background_writes.py). With the durable request log on (`answer_before_files`), a sampler save is
   answered without waiting for its files: its weights are frozen in the adapter store (samples read them at once)
   and the save is in the request log once acked, so a pool that dies before the files exist rebuilds them from
   the adapter's snapshot and log (pool/durable/pending_files.py); its row is recorded with FILES_PENDING and settled
   (size, hash) on the writer thread once the files are there (a row deleted meanwhile: the files go). Without the
   log, the finish waits for the files, and each adds its size and hash to its save's result; a failed write fails
   its save;
2. ONE SQL transaction, fenced by the lease (pool/records.check_leader): a `checkpoints` row for each successful save
   (so a client that sees a save's result can load it at once; a row of the same name is replaced), the plan's tier
   moves (`residency`), creations' statuses, the applied seq_id per adapter and usage per tenant (pool/records.py);
3. store the results (a result is visible only after its record);
4. ack the stream entries (and move them into the request log, when it is on).

A save whose row cannot be written fails, alone (each row in a SAVEPOINT). The database away (stopped, crashed,
restarting: storage/db.database_unavailable) is no reason to fail anything: the transaction is run again from its start
until it commits (storage/outage.retry_database, up to DATABASE_OUTAGE_S), and only then are the results stored. A
retry after a failed COMMIT first checks whether that COMMIT went through (PlanRecords.covered) and then writes nothing
again. The transaction failing for good (past the outage, or any other error) is logged: the plan's saves fail (their
rows are not there) and the results still go out, so recording never stalls every tenant. A deposed leader (its lease
lost: LeaseLostError) writes nothing, stores no result and acks nothing; the new leader runs the plan's requests again.

A crash before the results are stored redelivers the plan's requests; a save runs again, rewrites its files and
replaces its row."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.dispatch.hooks import AnsweredPlan, FinishStep
from loraplex.errors import EngineError, LeaseLostError, LoraplexError
from loraplex.pool.records import PlanRecords, TierChanges, check_leader, record_tier_moves
from loraplex.protocol import KINDS, SAVE_KINDS, BatchPlan, Outcome, PlannedRequest, RequestKind, SaveCheckpointPayload
from loraplex.protocol.checkpoint_paths import CheckpointKind
from loraplex.protocol.results import SaveResult
from loraplex.queue.lease import PoolLease
from loraplex.runtime.background_writes import BackgroundWrites
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.storage.db import database_unavailable
from loraplex.storage.models import Checkpoint
from loraplex.storage.outage import retry_database
from loraplex.storage.repositories import CheckpointRepository, unit_of_work
from loraplex.storage.repositories.checkpoints import FILES_PENDING
from loraplex.storage.types import utcnow

log = logging.getLogger(__name__)


class PlanFinish(FinishStep):
    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        pool: str = "",
        store: TierChanges | None = None,
        writes: BackgroundWrites | None = None,
        lease: PoolLease | None = None,
        answer_before_files: bool = False,
    ) -> None:
        """pool: record tier moves in `residency` as rank 0 of `pool`, and fence with its pools row; store: the rank-0
        adapter store, whose tier moves are drained on the loop thread right after each plan (`on_loop`: the thread
        that moves adapters); writes: the executor's background file writes; lease: fence every transaction with this
        lease's token (the pools row of `pool` must hold it); answer_before_files: answer a sampler save before its
        files are written (only where the answered save is in the durable request log: see the module doc)."""
        self._answer_before_files = answer_before_files
        self._sessions = sessions
        self._pool = pool
        self._store = store
        self._writes = writes
        self._lease = lease
        self._warn = RateLimitedLog(log, every_s=5.0)

    def on_loop(self, plan: BatchPlan) -> list[Any]:
        """The store's tier moves since the last plan (they are this plan's)."""
        return list(self._store.drain_changes()) if self._store is not None else []

    def __call__(self, answer: AnsweredPlan) -> None:
        """The plan's end, in order (see the module doc). LeaseLostError propagates: nothing stored, nothing acked."""
        outcomes = self.written(answer.plan, answer.outcomes)
        tier_moves = answer.from_loop if isinstance(answer.from_loop, list) else []
        rows: dict[str, str] = {}
        outcomes = self.record(answer.plan, outcomes, answer.busy_s, tier_moves, rows)
        answer.publish(outcomes)
        answer.ack()
        self._settle_later(answer.plan, rows)

    def written(self, plan: BatchPlan, outcomes: list[Outcome]) -> list[Outcome]:
        """Wait for the plan's background writes; complete their saves' results (a failed write fails its save)."""
        writing = [r for r in plan.requests if r.kind in SAVE_KINDS and self._writing(r)]
        if not writing or self._writes is None or self._answer_before_files:
            return outcomes
        settled: dict[str, Outcome] = {}
        by_id = {o.request_id: o for o in outcomes}
        for request in writing:
            outcome = by_id.get(request.request_id)
            try:
                files = self._writes.take(request.request_id)
            except Exception as exc:  # noqa: BLE001 - any failure to write is this save's error
                log.exception("writing the checkpoint of %s (request %s) failed", request.model_id, request.request_id)
                message = f"writing the checkpoint failed: {exc}"
                settled[request.request_id] = Outcome.failed(request.request_id, exc, message)
                continue
            if outcome is not None and outcome.ok and isinstance(outcome.result, SaveResult):
                written = replace(outcome.result, size_bytes=files["size_bytes"], sha256=files["sha256"])
                settled[request.request_id] = replace(outcome, result=written)
        return [settled.get(o.request_id, o) for o in outcomes]

    def _writing(self, request: PlannedRequest) -> bool:
        return self._writes is not None and self._writes.pending(request.request_id)

    def _settle_later(self, plan: BatchPlan, rows: dict[str, str]) -> None:
        """The saves answered before their files: each row settled (or the files removed) once its write is done."""
        if self._writes is None:
            return
        for request in plan.requests:
            if request.kind in SAVE_KINDS and self._writing(request):
                row = rows.get(request.request_id)  # None: its row is not there (the save failed)
                self._writes.then(request.request_id, partial(self._settle, request, row))

    def _settle(self, request: PlannedRequest, row: str | None, done: Future[dict[str, Any]]) -> None:
        """On the writer thread, the save's files written: their size and hash into its row, in a transaction fenced
        by the lease. A row gone meanwhile (the checkpoint was deleted) leaves no files behind; a failed write leaves
        the row pending (the sampler copy in the store still serves samples; a restart rebuilds the files)."""
        p = request.payload
        assert isinstance(p, SaveCheckpointPayload)
        try:
            files = done.result()
        except Exception:  # noqa: BLE001 - logged; the answer stands
            log.exception("writing the files of %s (request %s) failed after it was answered; its row stays pending",
                          p.path, request.request_id)  # fmt: skip
            return
        kind = _checkpoint_kind(request.kind)

        def write() -> bool:
            with unit_of_work(self._sessions) as session:
                check_leader(session, self._pool, self._lease)
                repo = CheckpointRepository(session, request.tenant_id)
                if row is not None and repo.settle(row, int(files["size_bytes"]), str(files["sha256"])):
                    return False
                return repo.find(request.model_id, kind, str(p.name)) is None

        try:
            gone = retry_database(write, "settling a checkpoint row", self._warn)
        except Exception:  # noqa: BLE001 - LeaseLostError or the database away for good: the row stays pending
            log.exception("the row of %s (request %s) was not settled", p.path, request.request_id)
            return
        if gone and p.directory:  # deleted while its files were being written: they go too
            shutil.rmtree(p.directory, ignore_errors=True)

    def record(
        self,
        plan: BatchPlan,
        outcomes: list[Outcome],
        seconds: float = 0.0,
        tier_moves: Sequence[Any] = (),
        rows: dict[str, str] | None = None,
    ) -> list[Outcome]:
        """The plan's one transaction (see the module doc); returns the outcomes with the saves whose row is not
        there failed. `seconds`: the plan's execution time (usage); tier_moves: where the store moved adapters;
        rows: filled with each recorded save's row id (request id -> checkpoints.id)."""
        rows = rows if rows is not None else {}
        records = PlanRecords.of(plan, outcomes, seconds)
        by_id = {o.request_id: o for o in outcomes}
        saves = [r for r in plan.requests if r.kind in SAVE_KINDS and isinstance(_result(by_id, r), SaveResult)]
        failed: dict[str, Outcome] = {}

        def fail(request: PlannedRequest, exc: Exception) -> None:
            log.exception("checkpoint of %s (request %s) not recorded", request.model_id, request.request_id)
            failed[request.request_id] = Outcome.failed(
                request.request_id, EngineError(f"checkpoint saved but not recorded: {exc}")
            )

        attempts = 0

        def write() -> None:
            nonlocal attempts
            attempts += 1
            with unit_of_work(self._sessions) as session:
                check_leader(session, self._pool, self._lease)  # LeaseLostError: nothing written
                if attempts > 1 and records.applied and records.covered(session):
                    return  # the attempt before committed (its rows and their failures stand); only its answer was lost
                failed.clear()  # a retry starts over: the rolled-back attempt wrote nothing
                rows.clear()
                for request in saves:
                    try:  # one row that cannot be written must not cost the others
                        with session.begin_nested():
                            result = by_id[request.request_id].result
                            assert isinstance(result, SaveResult)
                            row = _record_checkpoint(session, request, _checkpoint_kind(request.kind), result)
                            rows[request.request_id] = row.id
                    except (LoraplexError, SQLAlchemyError) as exc:
                        if database_unavailable(exc):
                            raise  # not this row's fault: the whole transaction again
                        fail(request, exc)
                record_tier_moves(session, self._pool, tier_moves)
                records.write(session)

        try:
            retry_database(write, "recording a plan", self._warn)
        except LeaseLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - the transaction itself failed: none of its rows is there
            log.exception("recording a plan of %d requests failed", len(plan.requests))
            for request in saves:
                fail(request, exc)
        return [failed.get(o.request_id, o) for o in outcomes]


def _result(by_id: dict[str, Outcome], request: PlannedRequest) -> object:
    outcome = by_id.get(request.request_id)
    return outcome.result if outcome is not None else None


def _record_checkpoint(
    session: Session, request: PlannedRequest, kind: CheckpointKind, result: SaveResult
) -> Checkpoint:
    """The row of a save the worker finished. The gateway put the name, folder URI and ttl in the payload; the files
    on disk (or being written: no hash yet, FILES_PENDING) are this save's, so a row of the same name (an overwrite,
    or a racing save) is replaced."""
    p = request.payload
    assert isinstance(p, SaveCheckpointPayload)
    ttl = p.ttl_seconds
    return CheckpointRepository(session, request.tenant_id).add(
        request.model_id,
        kind,
        str(p.name),
        str(p.blob_uri),
        result.size_bytes or 0,
        result.sha256 or FILES_PENDING,
        step=result.step,
        expires_at=utcnow() + timedelta(seconds=float(ttl)) if ttl else None,
        include_deleted=True,
        replace=True,
    )


def _checkpoint_kind(kind: RequestKind) -> CheckpointKind:
    """The checkpoints row's kind of a save request (protocol's table says which kinds save, and what)."""
    saves = KINDS[kind].saves
    assert saves is not None, f"{kind} saves no checkpoint"
    return saves
