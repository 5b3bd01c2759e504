"""What the dispatcher writes to SQL after each plan: adapter status, the applied seq_id per adapter (so a restarted
pool continues in order), usage per tenant, a `checkpoints` row per successful save (in its own transaction, before
the results are stored: see `record_checkpoints`), and where the pool's adapter store moved adapters (`snapshots`).
One transaction per plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import LoraplexError, NotFoundError
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
from loraplex.storage.models import AdapterStatus, CheckpointKind
from loraplex.storage.repositories import (
    AdapterRepository,
    CheckpointRepository,
    PoolRepository,
    SnapshotRepository,
    UsageRepository,
    unit_of_work,
)
from loraplex.storage.types import utcnow

log = logging.getLogger(__name__)


def _checkpoint_kind(kind: RequestKind) -> CheckpointKind:
    """The checkpoints row's kind of a save request (protocol's table says which kinds save, and what)."""
    return CheckpointKind(KINDS[kind].saves)


class TierChanges(Protocol):
    """The rank-0 adapter store (workers/adapter_store.AdapterStore): where adapters moved since the last drain."""

    def drain_changes(self) -> Sequence[Any]: ...


class OutcomeRecorder:
    def __init__(self, sessions: sessionmaker[Session], store: TierChanges | None = None, pool: str = "") -> None:
        """store, pool: record the store's tier changes in `snapshots` (as rank 0 of `pool`) with each plan."""
        self._sessions = sessions
        self._store = store
        self._pool = pool
        # id(plan) -> its execution seconds, until its outcomes are recorded (the finisher records plan k while plan k+1
        # runs, so one "last plan" value would be the wrong plan's).
        self._plan_seconds: dict[int, float] = {}

    def timed(self, executor: Executor) -> Executor:
        """Wrap the executor so each plan's wall time is known when its outcomes are recorded (usage seconds)."""
        recorder = self

        class _Timed:
            def execute(self, plan: BatchPlan) -> list[Outcome]:
                started = time.monotonic()
                try:
                    outcomes = executor.execute(plan)
                finally:
                    recorder._plan_seconds[id(plan)] = time.monotonic() - started
                return recorder.record_checkpoints(outcomes, plan)

        return _Timed()

    def record_checkpoints(self, outcomes: list[Outcome], plan: BatchPlan) -> list[Outcome]:
        """Add the `checkpoints` rows of the plan's successful saves, BEFORE the loop stores the results: a client that
        sees a save's result can load it at once. (A crash before the result is stored redelivers the save: it runs
        again, rewrites its files and replaces the row.) A save whose row cannot be written fails."""
        saves = [r for r in plan.requests if r.kind in SAVE_KINDS]
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
        try:
            with unit_of_work(self._sessions) as session:
                for request in done:
                    try:  # one row that cannot be written must not cost the others
                        with session.begin_nested():
                            _record_checkpoint(
                                session, request, _checkpoint_kind(request.kind), by_id[request.request_id].result
                            )
                    except (LoraplexError, SQLAlchemyError) as exc:
                        fail(request, exc)
        except SQLAlchemyError as exc:  # the transaction itself failed: none of the rows is there
            for request in done:
                fail(request, exc)
        return [failed.get(o.request_id, o) for o in outcomes]

    def _record_tiers(self, session: Session) -> None:
        """The store's tier moves since the last plan, in a SAVEPOINT: a failure there must not cost the other records
        (the changes are then lost for the table only; later moves of the same adapters write their rows again)."""
        if self._store is None:
            return
        changes = self._store.drain_changes()
        if not changes:
            return
        try:
            with session.begin_nested():
                SnapshotRepository(session).record_changes(self._pool, 0, changes)
        except SQLAlchemyError:
            log.exception("tier changes of %d adapters not recorded", len(changes))

    def applied_seq(self, model_id: str) -> int | None:
        with self._sessions() as session:
            return PoolRepository(session).applied_seq_id(model_id)

    def __call__(self, outcomes: list[Outcome], plan: BatchPlan) -> None:
        """One transaction per plan, one statement per adapter touched (its highest applied seq_id) plus one usage
        INSERT per tenant: this runs between a plan's end and its results becoming visible."""
        seconds = self._plan_seconds.pop(id(plan), 0.0)
        by_id = {o.request_id: o for o in outcomes}
        tokens = sum(r.num_tokens for r in plan.requests) or 1
        applied: dict[tuple[str, str], int] = {}  # (tenant, model_id) -> highest seq_id answered in this plan
        usage: dict[str, list[tuple[str | None, str, int, float]]] = {}
        with unit_of_work(self._sessions) as session:
            self._record_tiers(session)
            for request in plan.requests:
                outcome = by_id.get(request.request_id)
                if outcome is None:
                    continue
                if request.kind == RequestKind.CREATE_ADAPTER:
                    with suppress(NotFoundError):  # deleted before its creation finished
                        status = AdapterStatus.READY if outcome.ok else AdapterStatus.FAILED
                        AdapterRepository(session, request.tenant_id).set_status(request.model_id, status)
                if request.kind in (RequestKind.CREATE_ADAPTER, RequestKind.DELETE_ADAPTER):
                    continue  # outside the seq_id chain
                # A failed request still takes its place in the order: later seq_ids must not wait for it.
                key = (request.tenant_id, request.model_id)
                applied[key] = max(applied.get(key, request.seq_id), request.seq_id)
                if outcome.ok and request.kind in (RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD):
                    share = seconds * request.num_tokens / tokens  # the plan's time split by token share
                    row = (request.model_id, str(request.kind), request.num_tokens, share)
                    usage.setdefault(request.tenant_id, []).append(row)
            for (tenant_id, model_id), seq_id in applied.items():
                AdapterRepository(session, tenant_id).record_applied(model_id, seq_id, include_deleted=True)
            for tenant_id, rows in usage.items():
                UsageRepository(session, tenant_id).record_many(rows)


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
