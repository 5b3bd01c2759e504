"""Worker pools: each pool leader upserts its row on every heartbeat, and writes its fencing token there when it takes
the pool over (`take_leadership`); every plan's record transaction checks it first (`check_leader`). Not tenant data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

from sqlalchemy import Integer, bindparam, func, or_, select, update
from sqlalchemy.orm import Session

from loraplex.errors import LeaseLostError, NotFoundError
from loraplex.storage.enums import AdapterStatus
from loraplex.storage.models import Adapter, AdapterSnapshotRow, Pool, PoolState
from loraplex.storage.repositories.adapters import applied_at_least
from loraplex.storage.types import utcnow

# Every plan's record runs these two (a result waits for that record): built once and run on the session's connection
# as Core statements, the record of a closed-loop plan takes ~0.3 ms on SQLite instead of ~1.0 through the ORM
# (benchmarks/probe_plan_record.py; RESULTS.md, 2026-12-07, "the plan's record").
_RECORD_APPLIED = (
    update(Adapter)
    .where(Adapter.model_id == bindparam("mid"), Adapter.tenant_id == bindparam("tid"))
    .values(applied_seq_id=applied_at_least(bindparam("seq", type_=Integer)), last_used_at=bindparam("now"))
)
_LEADER_TOKEN_FOR_UPDATE = select(Pool.leader_token).where(Pool.name == bindparam("name")).with_for_update()


class PoolRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def applied_seq_id(self, model_id: str) -> int | None:
        """The last seq_id applied to an adapter, for a (re)starting dispatcher. The pool knows model ids only from
        requests the gateway already authorised, so this read needs no tenant."""
        return self.session.scalar(select(Adapter.applied_seq_id).where(Adapter.model_id == model_id))

    def record_applied(self, applied: Mapping[tuple[str, str], int]) -> None:
        """Several adapters' applied seq_ids, (tenant_id, model_id) -> seq_id, each as
        `AdapterRepository.record_applied(include_deleted=True)` writes one (never backwards, `last_used_at` touched),
        in one executemany UPDATE: a plan's record writes every adapter it answered at once. An adapter whose row is
        gone (none should be: a delete keeps the row) is passed over."""
        if not applied:
            return
        now = utcnow()
        params = [
            {"tid": tenant_id, "mid": model_id, "seq": seq_id, "now": now}
            for (tenant_id, model_id), seq_id in applied.items()
        ]
        self.session.connection().execute(_RECORD_APPLIED, params)
        for _, model_id in applied:  # a loaded copy in this session is stale now: the next read reloads it
            loaded = self.session.identity_map.get(self.session.identity_key(Adapter, model_id))
            if loaded is not None:
                self.session.expire(loaded, ["applied_seq_id", "last_used_at"])

    def adapter(self, model_id: str) -> Adapter | None:
        """An adapter by id, any tenant's and status: moving adapters between pools is the operator's and the pools'
        business (the pools know model ids only from requests the gateway already authorised)."""
        return self.session.get(Adapter, model_id)

    def route_adapter(self, model_id: str, source: str, target: str) -> bool:
        """The adapter, handed from `source` to `target` (queue/handoff.py), is placed on `target` from now: its
        requests go there, and so do its snapshot rows (a restart of `target` adopts it from them). Only while it is
        placed on `source` (or on no pool named: placed before the fleet), so a late call never undoes a later move;
        False when it was not."""
        placed = self.session.execute(
            update(Adapter)
            .where(Adapter.model_id == model_id, or_(Adapter.pool == source, Adapter.pool.is_(None)))
            .values(pool=target)
        )
        if not placed.rowcount:  # type: ignore[attr-defined]
            return False
        self.session.execute(
            update(AdapterSnapshotRow).where(AdapterSnapshotRow.model_id == model_id).values(pool=target)
        )
        return True

    def heartbeat(
        self,
        name: str,
        base_model: str,
        world_size: int,
        slots: int,
        restarted: bool = False,
        state: PoolState | None = None,
    ) -> Pool:
        """Create or refresh the pool's row. `restarted=True` (first beat after a start) resets `started_at`; `state`
        (when given) is what the pool is doing now (loading its model, ready, stopped)."""
        now = utcnow()
        pool = self.session.get(Pool, name)
        if pool is None:
            pool = Pool(name=name, started_at=now)
            self.session.add(pool)
        elif restarted:
            pool.started_at = now
        pool.base_model = base_model
        pool.world_size = world_size
        pool.slots = slots
        pool.heartbeat_at = now
        if state is not None:
            pool.state = state
        self.session.flush()
        return pool

    def leader_token(self, name: str) -> int | None:
        """The fencing token of the pool's last leader (a new one's token must be larger)."""
        return self.session.scalar(select(Pool.leader_token).where(Pool.name == name))

    def take_leadership(self, name: str, token: int, base_model: str, world_size: int, slots: int) -> bool:
        """Record `token` as the pool's leader (creating the row if needed); False when the row already holds a token
        at least as large (a newer leader took over): then nothing changes. The row is locked (FOR UPDATE on
        PostgreSQL; SQLite's write transaction holds the database), so a record transaction of the old leader
        commits wholly before this or sees the new token."""
        pool = self.session.get(Pool, name, with_for_update=True)
        now = utcnow()
        if pool is None:
            pool = Pool(name=name, base_model=base_model, world_size=world_size, slots=slots, heartbeat_at=now)
            self.session.add(pool)
        elif pool.leader_token is not None and pool.leader_token >= token:
            return False
        pool.leader_token = token
        pool.started_at = now
        pool.state = PoolState.LOADING  # until this leader has its model (pool/process.py sets READY)
        self.session.flush()
        return True

    def fence_out(self, name: str, token: int) -> bool:
        """A sibling pool took this dead pool's lease under `token` to fail it over (pool/failover.py): record the
        token, so a record transaction of the pool's old leader is refused from now (check_leader); the row's other
        fields are the dead pool's own. False when the row is missing or holds a token at least as large (a newer
        leader took over): then nothing changes."""
        pool = self.session.get(Pool, name, with_for_update=True)
        if pool is None or (pool.leader_token is not None and pool.leader_token >= token):
            return False
        pool.leader_token = token
        self.session.flush()
        return True

    def check_leader(self, name: str, token: int) -> None:
        """Raise LeaseLostError unless `token` leads the pool; locks the row until the transaction ends, so a takeover
        cannot commit in between. The first statement of each plan's record transaction (one round trip)."""
        current = self.session.connection().scalar(_LEADER_TOKEN_FOR_UPDATE, {"name": name})
        if current != token:
            raise LeaseLostError(f"pool {name}: token {token} no longer leads it (the pools row holds {current})")

    def set_state(self, name: str, state: PoolState) -> None:
        """Record the pool's state without a heartbeat (a clean stop: STOPPED)."""
        pool = self.session.get(Pool, name)
        if pool is not None:
            pool.state = state
            self.session.flush()

    def placed_adapters(self, names: Sequence[str]) -> dict[str, int]:
        """Live adapters placed on each of these pools (every tenant's: placement weighs the whole load), 0 for none.
        On PostgreSQL the pools' rows are locked first (FOR UPDATE, in name order) until the transaction ends, so
        concurrent placements on the same pools count each other's adapters instead of choosing alike; SQLite's
        write transaction serialises them anyway."""
        ordered = sorted(set(names))
        self.session.execute(select(Pool.name).where(Pool.name.in_(ordered)).order_by(Pool.name).with_for_update())
        stmt = (
            select(Adapter.pool, func.count())
            .where(Adapter.pool.in_(ordered), Adapter.status != AdapterStatus.DELETED)
            .group_by(Adapter.pool)
        )
        counts = {pool: int(n) for pool, n in self.session.execute(stmt) if pool is not None}
        return {name: counts.get(name, 0) for name in ordered}

    def set_draining(self, name: str, draining: bool) -> None:
        """Drain (True) or undrain the pool; NotFoundError for a pool that never ran."""
        pool = self.session.get(Pool, name, with_for_update=True)
        if pool is None:
            raise NotFoundError(f"pool {name!r} not found")
        pool.draining = draining
        self.session.flush()

    def draining(self, names: Sequence[str]) -> set[str]:
        """Those of these pools an operator drained."""
        return set(self.session.scalars(select(Pool.name).where(Pool.name.in_(list(names)), Pool.draining)))

    def live_adapters_on(self, name: str, include_unplaced: bool = False) -> list[str]:
        """The live adapters placed on the pool (with `include_unplaced`: also those placed on no pool named, the
        gateway's own pool's from before the fleet), sorted."""
        on = Adapter.pool == name
        stmt = select(Adapter.model_id).where(
            or_(on, Adapter.pool.is_(None)) if include_unplaced else on,
            Adapter.status.not_in([AdapterStatus.DELETED, AdapterStatus.FAILED]),
        )
        return sorted(self.session.scalars(stmt))

    def find(self, name: str) -> Pool | None:
        return self.session.get(Pool, name)

    def get(self, name: str) -> Pool:
        pool = self.session.get(Pool, name)
        if pool is None:
            raise NotFoundError(f"pool {name!r} not found")
        return pool

    def list(self, alive_within: timedelta | None = None) -> list[Pool]:
        """All pools, or only those that sent a heartbeat within `alive_within`."""
        stmt = select(Pool)
        if alive_within is not None:
            stmt = stmt.where(Pool.heartbeat_at >= utcnow() - alive_within)
        return list(self.session.scalars(stmt.order_by(Pool.name)))
