"""Adapters of one tenant. Every query is scoped to `tenant_id`; another tenant's adapter is indistinguishable from
a missing one (same NotFoundError message), so ids are never confirmed across tenants."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, bindparam, case, func, or_, select, update
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.storage.db import single_read
from loraplex.storage.enums import AdapterStatus
from loraplex.storage.models import MODEL_ID_LENGTH, Adapter
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.types import utcnow


def _not_found(model_id: str) -> NotFoundError:
    return NotFoundError(f"adapter {model_id!r} not found")


# Built once: the training calls' check runs it on every request, and building the WHERE clause anew cost more than
# the read itself. SQLAlchemy's compiled cache then serves its SQL.
_LIVE_POOL = select(Adapter.pool).where(
    Adapter.model_id == bindparam("model_id"),
    Adapter.tenant_id == bindparam("tenant_id"),
    Adapter.status != AdapterStatus.DELETED,
)


def applied_at_least(seq_id: Any) -> Any:
    """The applied seq_id column raised to `seq_id` (a number or a bind parameter) and never lowered, inside the UPDATE
    itself, so that concurrent writers cannot move it backwards."""
    return case(
        (or_(Adapter.applied_seq_id.is_(None), Adapter.applied_seq_id < seq_id), seq_id), else_=Adapter.applied_seq_id
    )


def live_pool_of(engine: Engine, tenant_id: str, model_id: str) -> str | None:
    """`AdapterRepository.live_pool` as one statement on a plain connection (no ORM session, no BEGIN): the training
    calls' hot check. Read afresh every time (no cache), so a deleted adapter is refused, and a moved one's requests go
    to its new pool, from the commit on."""
    with single_read(engine) as conn:
        row = conn.execute(_LIVE_POOL, {"model_id": model_id, "tenant_id": tenant_id}).first()
    if row is None:
        raise _not_found(model_id)
    return row[0]


class AdapterRepository:
    def __init__(self, session: Session, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def create(
        self,
        model_id: str,
        base_model: str,
        rank: int,
        alpha: float,
        target_modules: Sequence[str],
        seed: int,
        session_id: str | None = None,
        user_metadata: dict[str, Any] | None = None,
        pool: str | None = None,
    ) -> Adapter:
        _validate(model_id, rank, alpha, target_modules)
        # Ids are global (the primary key); a clash with a deleted or foreign adapter is still a clash.
        if self.session.get(Adapter, model_id) is not None:
            raise ConflictError(f"adapter {model_id!r} already exists")
        adapter = Adapter(
            model_id=model_id,
            tenant_id=self.tenant_id,
            base_model=base_model,
            rank=rank,
            alpha=float(alpha),
            target_modules=list(target_modules),
            seed=seed,
            status=AdapterStatus.CREATING,
            session_id=session_id,
            user_metadata=dict(user_metadata or {}),
            pool=pool,
        )
        add_or_conflict(self.session, adapter, f"adapter {model_id!r} already exists")
        return adapter

    def find(self, model_id: str) -> Adapter | None:
        """This tenant's adapter of this id, deleted or not (None if there is none)."""
        return self.session.scalar(select(Adapter).where(Adapter.model_id == model_id, Adapter.tenant_id == self.tenant_id))

    def get(self, model_id: str, include_deleted: bool = False) -> Adapter:
        """A live adapter of this tenant (or a deleted one too, with `include_deleted`), else NotFoundError."""
        stmt = select(Adapter).where(Adapter.model_id == model_id, Adapter.tenant_id == self.tenant_id)
        if not include_deleted:
            stmt = stmt.where(Adapter.status != AdapterStatus.DELETED)
        adapter = self.session.scalar(stmt)
        if adapter is None:
            raise _not_found(model_id)
        return adapter

    def check_live(self, model_id: str) -> None:
        """NotFoundError unless a live adapter of this tenant has this id (one column read: the training calls' check)."""
        self.live_pool(model_id)

    def live_pool(self, model_id: str) -> str | None:
        """The pool a live adapter of this tenant is placed on (None: placed before the fleet, the gateway's own);
        NotFoundError unless there is one (one row read: the training calls' check and their route)."""
        row = self.session.execute(_LIVE_POOL, {"model_id": model_id, "tenant_id": self.tenant_id}).first()
        if row is None:
            raise _not_found(model_id)
        return row[0]

    def count_live(self) -> int:
        """Adapters of this tenant not deleted (the adapter quota's count)."""
        stmt = select(func.count()).where(Adapter.tenant_id == self.tenant_id, Adapter.status != AdapterStatus.DELETED)
        return int(self.session.execute(stmt).scalar_one())

    def list(self, session_id: str | None = None, include_deleted: bool = False) -> list[Adapter]:
        stmt = select(Adapter).where(Adapter.tenant_id == self.tenant_id)
        if not include_deleted:
            stmt = stmt.where(Adapter.status != AdapterStatus.DELETED)
        if session_id is not None:
            stmt = stmt.where(Adapter.session_id == session_id)
        return list(self.session.scalars(stmt.order_by(Adapter.created_at, Adapter.model_id)))

    def count(self, include_deleted: bool = False) -> int:
        stmt = select(func.count()).select_from(Adapter).where(Adapter.tenant_id == self.tenant_id)
        if not include_deleted:
            stmt = stmt.where(Adapter.status != AdapterStatus.DELETED)
        return int(self.session.execute(stmt).scalar_one())

    def page(self, limit: int, offset: int, include_deleted: bool = False) -> builtins.list[Adapter]:
        """Adapters of this tenant, newest first (ties: model_id), `limit` of them after the first `offset`."""
        stmt = select(Adapter).where(Adapter.tenant_id == self.tenant_id)
        if not include_deleted:
            stmt = stmt.where(Adapter.status != AdapterStatus.DELETED)
        stmt = stmt.order_by(Adapter.created_at.desc(), Adapter.model_id.desc()).limit(limit).offset(offset)
        return list(self.session.scalars(stmt))

    def set_status(self, model_id: str, status: AdapterStatus) -> Adapter:
        adapter = self.get(model_id)
        adapter.status = AdapterStatus(status)
        self.session.flush()
        return adapter

    def mark_deleted(self, model_id: str) -> Adapter:
        """Soft delete: the row stays (usage, checkpoints refer to it) but the adapter is gone for the tenant."""
        return self.set_status(model_id, AdapterStatus.DELETED)

    def record_applied(self, model_id: str, seq_id: int, include_deleted: bool = False) -> int:
        """Record that `seq_id` took effect (and touch `last_used_at`); returns the stored value. Never moves
        backwards, even when processes race: the max is taken inside one UPDATE statement. `include_deleted` lets
        the dispatcher account for requests that were queued before the adapter was deleted."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:
            raise InvalidRequestError(f"seq_id must be a non-negative integer, got {seq_id!r}")
        scope = [Adapter.model_id == model_id, Adapter.tenant_id == self.tenant_id]
        if not include_deleted:
            scope.append(Adapter.status != AdapterStatus.DELETED)
        stmt = (
            update(Adapter)
            .where(*scope)
            .values(
                applied_seq_id=applied_at_least(seq_id),
                last_used_at=utcnow(),
            )
            .returning(Adapter.applied_seq_id)
            .execution_options(synchronize_session=False)
        )
        applied = self.session.scalar(stmt)
        if applied is None:
            raise _not_found(model_id)
        # A loaded copy in this session is now stale: expire the two columns so the next read reloads them.
        loaded = self.session.identity_map.get(self.session.identity_key(Adapter, model_id))
        if loaded is not None:
            self.session.expire(loaded, ["applied_seq_id", "last_used_at"])
        return applied


def _validate(model_id: str, rank: int, alpha: float, target_modules: Sequence[str]) -> None:
    if not isinstance(model_id, str) or not 0 < len(model_id) <= MODEL_ID_LENGTH:
        raise InvalidRequestError(f"model_id must be 1-{MODEL_ID_LENGTH} characters")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidRequestError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:  # also rejects NaN
        raise InvalidRequestError(f"alpha must be positive, got {alpha!r}")
    if isinstance(target_modules, str) or not target_modules or not all(isinstance(m, str) for m in target_modules):
        raise InvalidRequestError("target_modules must be a non-empty list of module names")
