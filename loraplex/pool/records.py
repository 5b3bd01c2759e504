"""What the dispatcher writes to SQL after each plan (its `on_outcomes`): adapter status, the applied seq_id per adapter
(so a restarted pool continues in order), usage per tenant, and where the pool's adapter store moved adapters
(`residency`), one transaction per plan; and the lookup of an adapter's applied seq_id. The `checkpoints` rows of
saves are written earlier, before the results (pool/recording_executor.py).

Fencing (`lease=`, the pool's way): each of these transactions first checks that the pools row still holds this
process's fencing token (`check_leader`: one SELECT ... FOR UPDATE); when another pool process took the pool over,
the transaction rolls back, the lease is marked lost, and LeaseLostError propagates: a deposed leader records nothing.

The database away (stopped, crashed, restarting: storage/db.database_unavailable): the plan's transaction is run
again from its start until it commits (storage/outage.retry_database, up to DATABASE_OUTAGE_S), and the finisher
stores the plan's results only after that, so a result never shows before its record. A retry after a failed COMMIT
cannot know whether that COMMIT went through: it first reads the plan's adapters' applied seq_ids, and when they
already cover the plan (plans are recorded one at a time, in order, so only this plan's COMMIT can have put them
there) it writes nothing again, so usage is never counted twice. The applied seq_id lookup waits the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.dispatch.tenant_weights import Fetch
from loraplex.errors import LeaseLostError, NotFoundError
from loraplex.protocol import (
    KINDS,
    UNCHAINED_KINDS,
    BatchPlan,
    Outcome,
    RequestKind,
)
from loraplex.queue.lease import PoolLease
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.storage.db import database_unavailable
from loraplex.storage.models import AdapterStatus
from loraplex.storage.outage import retry_database
from loraplex.storage.repositories import (
    AdapterRepository,
    PoolRepository,
    ResidencyRepository,
    TenantRepository,
    UsageRepository,
    unit_of_work,
)

log = logging.getLogger(__name__)


class TierChanges(Protocol):
    """The rank-0 adapter store (workers/adapter_store.AdapterStore): where adapters moved since the last drain."""

    def drain_changes(self) -> Sequence[Any]: ...


class PlanNotes:
    """What the RecordingExecutor learns about each plan on the loop thread (its execution seconds, and the store's
    tier moves drained right after it ran), kept by id(plan) until the recorder takes them on the finisher thread:
    the finisher records plan k while plan k+1 runs, so one "last plan" value would be the wrong plan's, and the
    store must only be touched by the thread that moves adapters."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._changes: dict[int, list[Any]] = {}

    def put(self, plan: BatchPlan, seconds: float, changes: Sequence[Any] = ()) -> None:
        self._seconds[id(plan)] = seconds
        if changes:
            self._changes[id(plan)] = list(changes)

    def take(self, plan: BatchPlan) -> tuple[float, list[Any]]:
        return self._seconds.pop(id(plan), 0.0), self._changes.pop(id(plan), [])


def check_leader(session: Session, pool: str, lease: PoolLease | None) -> None:
    """The fencing check of a plan's record transaction (see the module doc); nothing without a lease."""
    if lease is None:
        return
    try:
        PoolRepository(session).check_leader(pool, lease.token or 0)
    except LeaseLostError as exc:
        lease.mark_lost(str(exc))
        raise


def applied_seq_lookup(sessions: sessionmaker[Session]) -> Callable[[str], int | None]:
    """The dispatcher's view of an adapter's last applied seq_id when it first meets it (SQL survives a restart)."""

    warn = RateLimitedLog(log, every_s=5.0)

    def read(model_id: str) -> int | None:
        with sessions() as session:
            return PoolRepository(session).applied_seq_id(model_id)

    def lookup(model_id: str) -> int | None:
        return retry_database(lambda: read(model_id), f"reading the applied seq_id of {model_id}", warn)

    return lookup


class OutcomeRecorder:
    """The dispatcher's `on_outcomes`: statuses, applied seq_ids, usage and tier moves of one plan, one transaction."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        store: TierChanges | None = None,
        pool: str = "",
        notes: PlanNotes | None = None,
        lease: PoolLease | None = None,
    ) -> None:
        """pool: record tier changes in `residency` as rank 0 of `pool`; notes: each plan's execution seconds (usage)
        and tier moves, from the RecordingExecutor (the pool's way); store: drain a store here instead (only where
        nothing else moves adapters at the same time: a single-threaded caller); lease: fence every transaction with
        this lease's token (the pools row of `pool` must hold it)."""
        self._sessions = sessions
        self._lease = lease
        self._store = store
        self._pool = pool
        self._notes = notes or PlanNotes()
        self._warn = RateLimitedLog(log, every_s=5.0)

    def _record_tiers(self, session: Session, changes: list[Any]) -> None:
        """The plan's tier moves, in a SAVEPOINT: a failure there must not cost the other records (the changes are
        then lost for the table only; later moves of the same adapters write their rows again). The database
        going away is no such failure: the whole transaction runs again."""
        if not changes:
            return
        try:
            with session.begin_nested():
                ResidencyRepository(session).record_changes(self._pool, 0, changes)
        except SQLAlchemyError as exc:
            if database_unavailable(exc):
                raise
            log.exception("tier changes of %d adapters not recorded", len(changes))

    def __call__(self, outcomes: list[Outcome], plan: BatchPlan) -> None:
        """One transaction per plan, one statement per adapter touched (its highest applied seq_id) plus one usage
        INSERT per tenant: this runs between a plan's end and its results becoming visible. While the database is
        away it waits and runs the transaction again (see the module doc)."""
        seconds, changes = self._notes.take(plan)
        if self._store is not None:
            changes = changes + list(self._store.drain_changes())
        by_id = {o.request_id: o for o in outcomes}
        tokens = sum(r.num_tokens for r in plan.requests if KINDS[r.kind].counts_usage) or 1
        statuses: list[tuple[str, str, AdapterStatus]] = []  # creations: (tenant, model_id, status)
        applied: dict[tuple[str, str], int] = {}  # (tenant, model_id) -> highest seq_id answered in this plan
        usage: dict[str, list[tuple[str | None, str, int, float]]] = {}
        for request in plan.requests:
            outcome = by_id.get(request.request_id)
            if outcome is None:
                continue
            if request.kind == RequestKind.CREATE_ADAPTER:
                status = AdapterStatus.READY if outcome.ok else AdapterStatus.FAILED
                statuses.append((request.tenant_id, request.model_id, status))
            if request.kind in UNCHAINED_KINDS:
                continue  # outside the seq_id chain (create, delete, sample)
            # A failed request still takes its place in the order: later seq_ids must not wait for it.
            key = (request.tenant_id, request.model_id)
            applied[key] = max(applied.get(key, request.seq_id), request.seq_id)
            if outcome.ok and KINDS[request.kind].counts_usage:
                share = seconds * request.num_tokens / tokens  # the plan's time split by token share
                row = (request.model_id, str(request.kind), request.num_tokens, share)
                usage.setdefault(request.tenant_id, []).append(row)
        attempts = 0

        def record() -> None:
            nonlocal attempts
            attempts += 1
            with unit_of_work(self._sessions) as session:
                check_leader(session, self._pool, self._lease)
                if attempts > 1 and applied and _covered(session, applied):
                    return  # the attempt before committed; only its answer was lost
                self._record_tiers(session, changes)
                for tenant_id, model_id, status in statuses:
                    with suppress(NotFoundError):  # deleted before its creation finished
                        AdapterRepository(session, tenant_id).set_status(model_id, status)
                for (tenant_id, model_id), seq_id in applied.items():
                    AdapterRepository(session, tenant_id).record_applied(model_id, seq_id, include_deleted=True)
                for tenant_id, rows in usage.items():
                    UsageRepository(session, tenant_id).record_many(rows)

        retry_database(record, "recording a plan", self._warn)


def _covered(session: Session, applied: dict[tuple[str, str], int]) -> bool:
    """Every adapter's applied seq_id in SQL is already at least this plan's."""
    repo = PoolRepository(session)
    for (_, model_id), seq_id in applied.items():
        current = repo.applied_seq_id(model_id)
        if current is None or current < seq_id:
            return False
    return True


def sql_weights(sessions: sessionmaker[Session]) -> Fetch:
    """Fetch weights from the `tenants` table."""

    def fetch(tenant_ids: Collection[str]) -> Mapping[str, float]:
        with sessions() as session:
            return TenantRepository(session).weights(tenant_ids)

    return fetch
