"""A (re)starting pool adopts its adapters (DESIGN, Durability), before its dispatcher reads anything:

1. the adapters to adopt: those with a snapshot row of this pool or a request log on it, or handed to it
   (pool/handoff.py), neither deleted nor failed (a deleted adapter's log is dropped); not those it handed to another
   pool (their placement in SQL is finished now if a crash came between the hand-over and it);
2. for each, its newest snapshot whose file passes the hash check (a failing one is logged as an error and skipped for
   the one before it; never loaded) goes into the adapter store's host tier, bit for bit;
3. the logged requests after that snapshot's seq_id (queue/replay_log.py; the whole log, creation first, when there is
   no snapshot) run again in seq_id order, one at a time, through the pool's executor; their results were delivered
   already and are not sent again (nothing here writes a result); requests logged as failed or state-free only
   advance the seq_id;
   a sampler save answered before its files were written and whose files are not there runs again at its place in
   the log, writing them (pool/durable/pending_files.py);
4. the dispatcher starts from the seq_id reached (Dispatcher.seed_applied): requests still in the streams after it
   (accepted, not yet answered, or answered but not acked) are applied exactly once, by the dispatcher.

Replaying one request at a time is what the pool did when each plan held one adapter's step; where a plan mixed
adapters, the replayed float sums may differ in the last bits from the original run (the CPU matmuls are not
batch-invariant).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.errors import CorruptSnapshotError
from loraplex.pool.durable import pending_files
from loraplex.protocol import KINDS, UNCHAINED_KINDS, BatchPlan, Executor, RequestKind, SaveCheckpointPayload, Step
from loraplex.queue import handoff, replay_log
from loraplex.queue.envelope import to_planned
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.storage.outage import retry_database
from loraplex.storage.repositories import PoolRepository, SnapshotRepository, unit_of_work
from loraplex.storage.repositories.snapshots import SnapshotInfo, live_status
from loraplex.workers.state.durable_snapshot import read_durable_snapshot

if TYPE_CHECKING:
    import redis as redis_lib
    from sqlalchemy.orm import Session, sessionmaker

    from loraplex.runtime.background_writes import BackgroundWrites
    from loraplex.workers.state.adapter_store import AdapterStore
    from loraplex.workers.state.slot_images import SlotImage

log = logging.getLogger("loraplex.pool.durable")


@dataclass(frozen=True)
class Adopted:
    model_id: str
    tenant_id: str
    snapshot_version: int | None  # None: rebuilt from its creation
    snapshot_seq_id: int | None
    applied_seq_id: int | None  # where the dispatcher continues (None: no step yet)
    replayed: int  # requests run again
    replayed_steps: int  # of which optimizer steps


@dataclass
class Recovery:
    adopted: list[Adopted] = field(default_factory=list)
    skipped_snapshots: list[str] = field(default_factory=list)  # files that failed their check
    lost: list[str] = field(default_factory=list)  # adapters that could not be rebuilt

    @property
    def seeds(self) -> dict[str, int | None]:
        """Where the dispatcher continues for each adopted adapter (None: before its first step)."""
        return {a.model_id: a.applied_seq_id for a in self.adopted}


def recover_pool(
    *,
    pool: str,
    store: AdapterStore,
    executor: Executor,
    sessions: sessionmaker[Session],
    redis: redis_lib.Redis,
    adopt: Callable[[SlotImage], None] | None = None,
    writes: BackgroundWrites | None = None,
) -> Recovery:
    """adopt: takes a snapshot's slot image into the pool (default `store.adopt`; a multi-rank pool's
    LeaderExecutor.adopt gives it to every rank); writes: the executor's background file writes (a sampler save run
    again is waited for)."""
    out = Recovery()
    with sessions() as session:
        candidates = set(SnapshotRepository(session).live_adapters(pool))
    candidates |= set(replay_log.logged_adapters(redis, pool))
    candidates |= set(handoff.adopt_orders(redis, pool))  # handed here, not adopted yet
    for model_id, target in handoff.moved_away(redis, pool).items():
        if model_id in candidates:  # handed over before a crash: its new pool adopts it; finish placing it there
            candidates.discard(model_id)
            route_handed_over(sessions, model_id, pool, target)
    for model_id in sorted(candidates):
        adopt_adapter(pool=pool, model_id=model_id, store=store, executor=executor, sessions=sessions, redis=redis,
                      adopt=adopt, writes=writes, out=out)  # fmt: skip
    handoff.adopted(redis, pool, [a.model_id for a in out.adopted] + out.lost)
    if out.adopted or out.lost:
        log.info("pool %s: adopted %d adapters (%d requests replayed)%s", pool, len(out.adopted),
                 sum(a.replayed for a in out.adopted), f"; could not rebuild {out.lost}" if out.lost else "")  # fmt: skip
    return out


def adopt_adapter(
    *,
    pool: str,
    model_id: str,
    store: AdapterStore,
    executor: Executor,
    sessions: sessionmaker[Session],
    redis: redis_lib.Redis,
    adopt: Callable[[SlotImage], None] | None = None,
    writes: BackgroundWrites | None = None,
    out: Recovery,
) -> Adopted | None:
    """One adapter of this pool (a restart's, or one handed to it: pool/handoff.py) adopted from its newest valid
    snapshot and the request log after it, appended to `out` (or to `out.lost`); None when it is not live (its log is
    dropped) or cannot be rebuilt."""
    with sessions() as session:
        live = live_status(session, model_id)
        snapshots = [s for s in SnapshotRepository(session).newest_first(model_id)]
    if not live:
        replay_log.drop(redis, pool, model_id)
        return None
    files = _Files(sessions, writes)
    adopted = _adopt_one(pool, model_id, snapshots, store.signature.width, adopt or store.adopt, executor, redis, out,
                         files)  # fmt: skip
    if adopted is not None:
        out.adopted.append(adopted)
    return adopted


def route_handed_over(sessions: sessionmaker[Session], model_id: str, source: str, target: str) -> None:
    """Place a handed-over adapter on its new pool in SQL (PoolRepository.route_adapter), retried while the database
    is away: its requests go straight there from now."""
    def write() -> None:
        with unit_of_work(sessions) as session:
            PoolRepository(session).route_adapter(model_id, source, target)

    retry_database(write, f"placing adapter {model_id} on pool {target}", RateLimitedLog(log, every_s=10.0))


def _newest_valid(
    snapshots: list[SnapshotInfo], width: int, out: Recovery
) -> tuple[SnapshotInfo, SlotImage, int] | None:
    for info in snapshots:
        try:
            image, seq = read_durable_snapshot(Path(info.path), info.sha256, width)
        except CorruptSnapshotError as exc:
            log.error("adapter %s: snapshot v%d skipped for the one before it: %s", info.model_id, info.version, exc)
            out.skipped_snapshots.append(info.path)
            continue
        return info, image, seq
    return None


def _adopt_one(
    pool: str,
    model_id: str,
    snapshots: list[SnapshotInfo],
    width: int,
    adopt: Callable[[SlotImage], None],
    executor: Executor,
    redis: redis_lib.Redis,
    out: Recovery,
    files: _Files | None = None,
) -> Adopted | None:
    found = _newest_valid(snapshots, width, out)
    after = found[2] if found is not None else None
    entries = replay_log.read_after(redis, pool, model_id, after)
    if found is None and not (entries and entries[0].envelope.kind == RequestKind.CREATE_ADAPTER):
        log.error("adapter %s: no valid snapshot and no logged creation: its state cannot be rebuilt", model_id)
        out.lost.append(model_id)
        return None
    tenant = entries[0].envelope.tenant_id if entries else None
    last: int | None = None
    if found is not None:
        info, image, seq = found
        image.model_id = model_id
        adopt(image)
        last = seq if seq >= 0 else None
        tenant = tenant or _tenant_of(info)
        if entries and last is not None and entries[0].seq_id > last + 1:
            log.warning("adapter %s: its log starts at seq_id %d, after the snapshot's %d", model_id,
                        entries[0].seq_id, last)  # fmt: skip
    replayed = steps = 0
    pending = files.pending(tenant or "", model_id, entries) if files is not None else {}
    for index, entry in enumerate(entries):
        request = to_planned(entry.envelope)
        if index in pending and files is not None:
            files.write_again(request, pending.pop(index), executor)
        if entry.apply:
            outcome = executor.execute(BatchPlan((Step(KINDS[request.kind].step, (request,)),)))
            if outcome and not outcome[0].ok:
                log.error("adapter %s: replaying %s seq_id %d failed now (%s: %s)", model_id, request.kind,
                          request.seq_id, outcome[0].error_name, outcome[0].error)  # fmt: skip
            replayed += 1
            steps += request.kind == RequestKind.OPTIM_STEP
        if request.kind not in UNCHAINED_KINDS:
            last = request.seq_id if last is None else max(last, request.seq_id)
    return Adopted(
        model_id, tenant or "", found[0].version if found else None, found[2] if found else None, last, replayed, steps
    )


@dataclass
class _Files:
    """The adapter's sampler checkpoints answered before their files were written (pool/durable/pending_files.py)."""

    sessions: sessionmaker[Session]
    writes: BackgroundWrites | None

    def pending(self, tenant: str, model_id: str, entries: list[replay_log.LoggedRequest]) -> dict[int, Any]:
        """Settles the rows whose files are complete; returns the others to write again: the index of the last logged
        save of each -> its row (a row whose save is not in the log is logged: it cannot be rebuilt)."""
        rows = pending_files.pending_rows(self.sessions, tenant, model_id)
        for name, row in list(rows.items()):
            complete = pending_files.complete_files(row)
            if complete is not None:
                pending_files.settle(self.sessions, tenant, row, complete)
                del rows[name]
        last: dict[str, int] = {}
        for index, entry in enumerate(entries):
            p = entry.envelope.payload
            if entry.envelope.kind == RequestKind.SAVE_SAMPLER and isinstance(p, SaveCheckpointPayload) and p.name in rows:
                last[str(p.name)] = index
        for name in rows.keys() - last.keys():  # answered and not acked, it is redelivered and runs again
            log.warning("adapter %s: sampler checkpoint %s has no files and its save is not in the request log: it is "
                        "rebuilt only if its request is still in its stream", model_id, name)  # fmt: skip
        return {index: rows[name] for name, index in last.items()}

    def write_again(self, request: Any, row: pending_files.PendingRow, executor: Executor) -> None:
        written = pending_files.write_again(request, executor, self.writes)
        if written is not None:
            pending_files.settle(self.sessions, request.tenant_id, row, written)
            log.info("adapter %s: the files of sampler checkpoint %s written again at seq_id %d", request.model_id,
                     row.name, request.seq_id)  # fmt: skip


def _tenant_of(info: SnapshotInfo) -> str:
    """The tenant from the snapshot's blob path (<blob_root>/<tenant>/<model>/snapshots/...)."""
    return Path(info.path).parents[2].name


def adopt_into(snapshotter: Any, recovery: Recovery) -> None:
    """Tell the snapshot cadence about the adopted adapters (replayed ones are due for a snapshot by the usual rules)."""
    for a in recovery.adopted:
        snapshotter.adopted(a.model_id, a.tenant_id, a.replayed_steps, changed=a.replayed > 0 or a.snapshot_version is None)
