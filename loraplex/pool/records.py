"""What a plan changes in SQL besides its checkpoint rows, as the pool's finish step (pool/finish.py) writes it inside
its one transaction per plan: adapter status, the applied seq_id per adapter (so a restarted pool continues in order),
usage per tenant, and where the pool's adapter store moved adapters (`residency`); the fencing check every pool
transaction starts with; and the SQL lookups the dispatcher is given (an adapter's applied seq_id, tenant weights).

Fencing (`check_leader`, with the pool's lease): the transaction first checks that the pools row still holds this
process's fencing token (one SELECT ... FOR UPDATE); when another pool process took the pool over, the transaction
rolls back, the lease is marked lost, and LeaseLostError propagates: a deposed leader records nothing.

A retry after a failed COMMIT (storage/outage.retry_database) cannot know whether that COMMIT went through: the finish
step first reads the plan's adapters' applied seq_ids (`PlanRecords.covered`), and when they already cover the plan
(plans are recorded one at a time, in order, so only this plan's COMMIT can have put them there) it writes nothing
again, so usage is never counted twice. The applied seq_id lookup waits for the database the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
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
)
from loraplex.storage.repositories.usage import record_usage_of_tenants

log = logging.getLogger(__name__)


class TierChanges(Protocol):
    """The rank-0 adapter store (workers/adapter_store.AdapterStore): where adapters moved since the last drain."""

    def drain_changes(self) -> Sequence[Any]: ...


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


@dataclass
class PlanRecords:
    """One plan's records: creations' statuses, the highest applied seq_id per adapter, usage rows per tenant."""

    statuses: list[tuple[str, str, AdapterStatus]] = field(default_factory=list)  # (tenant, model_id, status)
    applied: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, model_id) -> highest seq_id
    usage: dict[str, list[tuple[str | None, str, int, float]]] = field(default_factory=dict)  # tenant -> rows

    @classmethod
    def of(cls, plan: BatchPlan, outcomes: Sequence[Outcome], seconds: float) -> PlanRecords:
        """The records of `plan` answered with `outcomes`; `seconds`: the plan's execution time, split over its
        usage rows by token share."""
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
        return cls(statuses, applied, usage)

    def covered(self, session: Session) -> bool:
        """Every adapter's applied seq_id in SQL is already at least this plan's (its COMMIT went through)."""
        repo = PoolRepository(session)
        for (_, model_id), seq_id in self.applied.items():
            current = repo.applied_seq_id(model_id)
            if current is None or current < seq_id:
                return False
        return True

    def write(self, session: Session) -> None:
        """Creations' statuses one by one (rare), then every adapter's highest applied seq_id in one executemany
        UPDATE and every tenant's usage in one INSERT, whatever the number of adapters and tenants in the plan."""
        for tenant_id, model_id, status in self.statuses:
            with suppress(NotFoundError):  # deleted before its creation finished
                AdapterRepository(session, tenant_id).set_status(model_id, status)
        PoolRepository(session).record_applied(self.applied)
        record_usage_of_tenants(session, self.usage)


def record_tier_moves(session: Session, pool: str, changes: Sequence[Any]) -> None:
    """The plan's tier moves as rank 0 of `pool`, in a SAVEPOINT: a failure there must not cost the other records (the
    changes are then lost for the table only; later moves of the same adapters write their rows again). The database
    going away is no such failure: the whole transaction runs again."""
    if not changes:
        return
    try:
        with session.begin_nested():
            ResidencyRepository(session).record_changes(pool, 0, list(changes))
    except SQLAlchemyError as exc:
        if database_unavailable(exc):
            raise
        log.exception("tier changes of %d adapters not recorded", len(changes))


def sql_weights(sessions: sessionmaker[Session]) -> Fetch:
    """Fetch weights from the `tenants` table."""

    def fetch(tenant_ids: Collection[str]) -> Mapping[str, float]:
        with sessions() as session:
            return TenantRepository(session).weights(tenant_ids)

    return fetch
