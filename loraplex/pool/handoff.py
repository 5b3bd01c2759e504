"""Moving adapters between pools, the pool's side (the dispatcher's `Handoff` hook, dispatch/hooks.py; the Redis side:
queue/handoff.py; the operator's order: service/moves.py).

Handing over (the source pool's loop thread, between two plans, with every earlier plan finished, so every answered
request of the adapter is in its request log and none of its requests runs):
1. the sampler saves' files handed to the background writer are written, and the adapter's snapshot being written
   (if any) is recorded: what the target adopts is on disk;
2. one Redis script fenced by this pool's lease (queue/handoff.Handoffs.hand_over): the request log, the unanswered
   entries, the forwarding address, the adopt order;
3. SQL: the adapter and its snapshot rows placed on the target (PoolRepository.route_adapter): gateways send its
   requests there from now (one that read the old pool just before still reaches this one, and is forwarded);
4. the adapter leaves this pool's store (every rank's: a delete step through the executor).

Adopting (the target's loop thread, when it first meets one of the adapter's requests; a restart adopts it too):
its newest valid snapshot and the request log after it (pool/durable/recovery.adopt_adapter), exactly as a restarted
pool adopts its own adapters; the loop continues from the seq_id reached.

A crash between 2 and 3 leaves SQL pointing at the source: the source forwards every entry it gets, and its next start
finishes 3 (recovery.py). Fencing is per pool: only the source's lease holder hands over (the script checks the
lease), and only the target's lease holder adopts and writes the adapter's records from then on.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loraplex.dispatch.hooks import Meeting
from loraplex.pool.durable.recovery import Recovery, adopt_adapter, route_handed_over
from loraplex.protocol import BatchPlan, DeleteAdapterPayload, Executor, PlannedRequest, RequestKind, Step, StepKind
from loraplex.queue import handoff, keys
from loraplex.queue.handoff import Handoffs
from loraplex.storage.enums import AdapterStatus
from loraplex.storage.repositories import PoolRepository

if TYPE_CHECKING:
    import redis as redis_lib
    from sqlalchemy.orm import Session, sessionmaker

    from loraplex.pool.durable.snapshotter import Snapshotter
    from loraplex.queue.lease import PoolLease
    from loraplex.runtime.background_writes import BackgroundWrites
    from loraplex.workers.state.adapter_store import AdapterStore

log = logging.getLogger("loraplex.pool.handoff")

FILES_WAIT_S = 600.0  # the most a hand-over waits for the sampler files being written


class PoolHandoff:
    def __init__(
        self,
        *,
        pool: str,
        redis: redis_lib.Redis,
        sessions: sessionmaker[Session],
        store: AdapterStore,
        executor: Executor,
        snapshotter: Snapshotter,
        lease: PoolLease | None = None,
        writes: BackgroundWrites | None = None,
        adopt: Any = None,
    ) -> None:
        """executor: rank 0's (a multi-rank pool's LeaderExecutor: every rank adopts and drops); adopt: how a snapshot's
        state enters the pool (default store.adopt; a multi-rank pool's LeaderExecutor.adopt)."""
        self.pool = pool
        self.redis = redis
        self.sessions = sessions
        self.store = store
        self.executor = executor
        self.snapshotter = snapshotter
        self.lease = lease
        self.writes = writes
        self.adopt = adopt
        self.scripts = Handoffs(redis)

    def orders(self) -> Mapping[str, str]:
        return handoff.move_orders(self.redis, self.pool)

    def hand_over(self, model_id: str, target: str) -> bool:
        with self.sessions() as session:
            row = PoolRepository(session).adapter(model_id)
            tenant_id, status = (row.tenant_id, row.status) if row is not None else ("", AdapterStatus.DELETED)
        if status in (AdapterStatus.DELETED, AdapterStatus.FAILED):
            log.warning("pool %s: move of adapter %s to %s dropped: it is gone", self.pool, model_id, target)
            self.redis.hdel(keys.move_orders(self.pool), model_id)
            return False
        if self.writes is not None:
            self.writes.barrier().result(timeout=FILES_WAIT_S)
        self.snapshotter.hand_over(model_id)
        started = time.monotonic()
        entries = handoff.entries_of(self.redis, self.pool, tenant_id, model_id)
        moved = self.scripts.hand_over(self.pool, target, tenant_id, model_id, entries, self.lease)
        route_handed_over(self.sessions, model_id, self.pool, target)
        if model_id in self.store:
            drop = PlannedRequest(f"handoff-{uuid.uuid4().hex}", tenant_id, model_id, -1, RequestKind.DELETE_ADAPTER,
                                  DeleteAdapterPayload())  # fmt: skip
            self.executor.execute(BatchPlan((Step(StepKind.DELETE, (drop,)),)))
        log.info("pool %s: adapter %s handed over to pool %s with %d queued requests (%.0f ms)", self.pool, model_id,
                 target, moved, 1000 * (time.monotonic() - started))  # fmt: skip
        return True

    def meet(self, model_id: str) -> Meeting | None:
        moved, ordered = handoff.meet(self.redis, self.pool, model_id)
        if moved is not None:
            return Meeting(forward_to=moved)
        if not ordered:
            return None
        out = Recovery()
        adopted = adopt_adapter(pool=self.pool, model_id=model_id, store=self.store, executor=self.executor,
                                sessions=self.sessions, redis=self.redis, adopt=self.adopt, writes=self.writes,
                                out=out)  # fmt: skip
        handoff.adopted(self.redis, self.pool, [model_id])
        if adopted is None:
            log.error("pool %s: adapter %s was handed here but could not be adopted", self.pool, model_id)
            return None
        self.snapshotter.adopted(model_id, adopted.tenant_id, adopted.replayed_steps,
                                 changed=adopted.replayed > 0 or adopted.snapshot_version is None)  # fmt: skip
        log.info("pool %s: adopted adapter %s (snapshot v%s, %d requests replayed, seq_id %s)", self.pool, model_id,
                 adopted.snapshot_version, adopted.replayed, adopted.applied_seq_id)  # fmt: skip
        return Meeting(adopted=True, applied=adopted.applied_seq_id)
