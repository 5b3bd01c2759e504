"""Failover: the adapters of a dead pool handed to the live pools of its base model by one of them (a thread of each
pool leader with durable snapshots; the rule: pool/failover_rule.py; the hand-over itself: queue/handoff.py).

Each round (every few seconds) a leader looks for dead siblings: pools of its base model with no live registration,
no live lease, and no registration for `pool_failover_seconds`, seen so by this leader for one lease TTL. For each one with live adapters placed on it in SQL:
1. targets: the live, undrained pools of the base model by the placement rule, counted one by one
   (placement.place_many), chosen before the lease is taken so a round with nowhere to go changes nothing;
2. the dead pool's lease, taken by this process (one Lua script: only one sibling can win it, and a process of the
   dead pool that comes back waits as a standby meanwhile), and its token written to the dead pool's SQL row
   (PoolRepository.fence_out): from then on the old leader's result writes and record transactions are refused, so a
   process of the dead pool that was only paused, not dead, cannot write once it wakes;
3. per adapter, the hand-over its pool would have done (pool/handoff.py), fenced by that lease: its request log and
   its unanswered entries to the target, a forwarding address on the dead pool, an adopt order on the target, then
   SQL places it on the target. An adapter found handed over already (a sweep that stopped between the Redis script
   and SQL) only has its SQL placement finished, to the pool it was handed to;
4. the lease released: the dead pool's next process takes it at once and starts with none of the adapters (SQL places
   them elsewhere, its request logs are gone), forwarding any late entry of them to where they went.
The targets adopt each adapter from its newest durable snapshot and the request log when they first meet one of its
requests, as after a move. A late entry a gateway still queues on the dead pool (it read the placement just before
SQL changed) is forwarded by the next round, as the source's loop would have done.

Exactly once: only the lease's winner hands over; every hand-over script checks that lease; an entry moves only if
this call deleted it from the dead pool's stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from loraplex.errors import LeaseLostError
from loraplex.pool.durable.recovery import route_handed_over
from loraplex.pool.failover_rule import dead_siblings, seen_dead_long_enough
from loraplex.queue import handoff, keys, pool_registry
from loraplex.queue.envelope import decode
from loraplex.queue.handoff import Handoffs
from loraplex.queue.lease import PoolLease, default_holder
from loraplex.queue.redis_text import text
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.service.placement import PoolLoad, place_many
from loraplex.storage.repositories import PoolRepository, unit_of_work

if TYPE_CHECKING:
    import redis as redis_lib
    from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("loraplex.pool.failover")


def sweep_interval(after_s: float) -> float:
    """How often a leader looks for dead siblings: a sixth of the failover time, between 0.5 and 5 s."""
    return min(5.0, max(0.5, after_s / 6))


class FailoverSweeper:
    def __init__(
        self,
        *,
        pool: str,
        base_model: str,
        redis: redis_lib.Redis,
        sessions: sessionmaker[Session],
        after_s: float,
        lease_ttl_s: float,
    ) -> None:
        self.pool, self.base_model = pool, base_model
        self.redis, self.sessions = redis, sessions
        self.after_s, self.lease_ttl_s = after_s, lease_ttl_s
        self.scripts = Handoffs(redis)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-failover", daemon=True)
        self._warn = RateLimitedLog(log, every_s=30.0)
        self._dead_since: dict[str, float] = {}  # pool -> when this sweeper first saw it dead (monotonic)

    def start(self) -> FailoverSweeper:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(sweep_interval(self.after_s)):
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 - Redis or the database away: the next round tries again
                self._warn.warning("pool %s: looking for dead sibling pools failed (%s: %s); retrying", self.pool,
                                   type(exc).__name__, exc)  # fmt: skip

    # -- one round ------------------------------------------------------------------------------------------------
    def sweep(self) -> dict[str, dict[str, str]]:
        """One round: dead pool -> {adapter: the pool it was handed to} for those this round failed over."""
        out = {}
        for dead in self.dead_pools():
            moved = self.fail_over(dead)
            if moved:
                out[dead] = moved
            self.forward_late_entries(dead)
        return out

    def dead_pools(self) -> list[str]:
        last_seen = pool_registry.registered_pools(self.redis)
        if len(last_seen) < 2:
            return []
        live = {p.name for p in pool_registry.live_pools(self.redis)}
        pipe = self.redis.pipeline(transaction=False)
        for name in last_seen:
            pipe.exists(keys.pool_leader(name))
        leased = {name for name, held in zip(last_seen, pipe.execute(), strict=True) if held}
        with self.sessions() as db:
            base_models = {p.name: p.base_model for p in PoolRepository(db).list()}
        candidates = dead_siblings(self.pool, self.base_model, last_seen, base_models, live, leased, time.time(),
                                   self.after_s)  # fmt: skip
        dead, self._dead_since = seen_dead_long_enough(candidates, self._dead_since, time.monotonic(), self.lease_ttl_s)
        return dead

    def targets(self, dead: str, count: int) -> list[str]:
        """Where `count` adapters of `dead` go: the live, undrained pools of the base model by the placement rule;
        [] when there is none."""
        siblings = [
            p for p in pool_registry.live_pools(self.redis) if p.base_model == self.base_model and p.name != dead
        ]
        if not siblings:
            return []
        names = [p.name for p in siblings]
        with self.sessions() as db:
            pools = PoolRepository(db)
            placed, draining = pools.placed_adapters(names), pools.draining(names)
        loads = [PoolLoad(p.name, p.slots, placed[p.name], p.queued_tokens, p.name in draining) for p in siblings]
        try:
            return place_many(loads, count)
        except ValueError:
            return []

    def fail_over(self, dead: str) -> dict[str, str]:
        """Hand every live adapter of `dead` to a sibling (the module doc); {} when it has none, when there is no
        sibling to take them, or when the lease is taken by another (a sibling's round, or the pool's own process)."""
        with self.sessions() as db:
            adapters = PoolRepository(db).live_adapters_on(dead)
        if not adapters or not self.targets(dead, len(adapters)):
            if adapters:
                self._warn.warning("pool %s: dead pool %s has %d adapters and no open sibling pool to take them",
                                   self.pool, dead, len(adapters))  # fmt: skip
            return {}
        lease = PoolLease(
            self.redis, dead, ttl_s=self.lease_ttl_s, holder=f"{default_holder()}:failover-by-{self.pool}"
        )
        with self.sessions() as db:
            floor = PoolRepository(db).leader_token(dead) or 0
        if not lease.try_acquire(floor):
            return {}
        try:
            with unit_of_work(self.sessions) as db:
                if not PoolRepository(db).fence_out(dead, lease.token or 0):
                    return {}  # a newer leader of the pool is in SQL
            lease.keep()
            with self.sessions() as db:  # again, under the lease: what a round before this one left
                adapters = PoolRepository(db).live_adapters_on(dead)
            targets = self.targets(dead, len(adapters))
            moved = {}
            for model_id, target in zip(adapters, targets, strict=False):
                moved[model_id] = self.hand_over(dead, model_id, target, lease)
            return moved
        except LeaseLostError as exc:
            log.error("pool %s: failing pool %s over stopped: %s", self.pool, dead, exc)
            return {}
        finally:
            lease.release()

    def hand_over(self, dead: str, model_id: str, target: str, lease: PoolLease) -> str:
        """One adapter of `dead` handed to `target` (or finished to where it was handed before); that pool's name."""
        started = time.monotonic()
        already = handoff.moved_to(self.redis, dead, model_id)
        if already is not None:
            route_handed_over(self.sessions, model_id, dead, already)
            log.warning("pool %s: adapter %s of dead pool %s was handed to pool %s already; placed there",
                        self.pool, model_id, dead, already)  # fmt: skip
            return already
        with self.sessions() as db:
            row = PoolRepository(db).adapter(model_id)
            tenant_id = row.tenant_id if row is not None else ""
        entries = handoff.entries_of(self.redis, dead, tenant_id, model_id)
        taken = self.scripts.hand_over(dead, target, tenant_id, model_id, entries, lease)
        route_handed_over(self.sessions, model_id, dead, target)
        log.warning("pool %s: adapter %s of dead pool %s handed over to pool %s with %d queued requests (failover, "
                    "%.0f ms)", self.pool, model_id, dead, target, taken, 1000 * (time.monotonic() - started))  # fmt: skip
        return target

    def forward_late_entries(self, dead: str) -> int:
        """Forward the entries queued on `dead` for adapters that left it (as its loop would); how many moved."""
        moved: Mapping[str, str] = handoff.moved_away(self.redis, dead)
        if not moved:
            return 0
        forwarded = 0
        for tenant in sorted(text(t) for t in cast(set, self.redis.smembers(keys.pool_tenants(dead)))):
            rows = cast(list[tuple[bytes, Mapping[Any, Any]]], self.redis.xrange(keys.request_stream(dead, tenant)))
            for sid, fields in rows:
                try:
                    model_id = decode(fields).model_id
                except Exception:  # noqa: BLE001 - an entry that does not decode is its own pool's to drop
                    continue
                if model_id in moved and self.scripts.forward(dead, tenant, model_id, text(sid)) is not None:
                    forwarded += 1
        if forwarded:
            log.warning("pool %s: %d late entries on dead pool %s forwarded", self.pool, forwarded, dead)
        return forwarded
