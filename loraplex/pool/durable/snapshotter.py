"""The pool's durable snapshots: when each adapter's state is written, and the writer thread that writes it.

After every plan (the dispatcher's `after_plan` hook, on the loop thread, the one thread that moves adapters; with an
empty plan once a second while the pool is idle) an adapter is due when it changed since its last snapshot and either had `every_steps` optimizer steps since, or `every_s` seconds
passed. Its state is taken there (AdapterStore.peek_async: weights, unconsumed gradients, Adam moments, step,
hyperparameters; a resident adapter's rows cloned on the device) together with the seq_id it covers (the loop's
applied seq_id, `LoopProgress.applied`: every answered request up to it is in that state), and the writer thread does the rest while training
goes on:

0. copy the state to host memory (a side stream's device-to-host copy, so the training kernels never queue behind it;
   the device clones of one round are bounded by `copy_budget_bytes`, adapters past it stay due for a later plan; a
   state larger than the budget by itself is copied synchronously instead, never cloned);
1. write the file (workers/state/durable_snapshot.py: atomic, fsynced, hashed);
2. wait until the dispatcher's finisher has stored the results of every plan up to this one (`after_finished`): a
   snapshot may only become the one a restart adopts once everything it covers was answered, or a restart would
   find requests it covers with no result to send; and until every sampler save's files handed to the background
   writer up to this plan are written (`writes.barrier`): a sampler save is answered before its files, and a restart
   rebuilds missing files by replaying the log after the newest snapshot, so no snapshot may pass a save whose
   files are not there yet (pool/durable/pending_files.py);
3. one transaction, fenced by the lease: its `adapter_snapshots` row, older rows past `keep` dropped; then the
   request log trimmed to the previous snapshot's seq_id (the log covers two snapshots, so a corrupt newest file can
   be skipped for the one before it); the dropped files removed.

A failed write (a full disk...) is logged and leaves the previous snapshot as it was; the adapter stays due and is
tried again after the next plan that touches it. Adapters with a request running in parts are skipped until its last
part (part of a request's gradient would be in the state). A deleted adapter's rows and files go once its delete is
answered. `flush` (a clean stop, after the last plan) writes every changed adapter and waits for the writer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.errors import LeaseLostError
from loraplex.pool.records import check_leader
from loraplex.protocol import KINDS, BatchPlan, RequestKind
from loraplex.queue import replay_log
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.storage.repositories import SnapshotRepository, unit_of_work
from loraplex.storage.repositories.snapshots import live_status
from loraplex.workers.state.durable_snapshot import write_durable_snapshot

if TYPE_CHECKING:
    import redis as redis_lib
    from sqlalchemy.orm import Session, sessionmaker

    from loraplex.dispatch.hooks import LoopProgress
    from loraplex.queue.lease import PoolLease
    from loraplex.runtime.background_writes import BackgroundWrites
    from loraplex.workers.state.adapter_store import AdapterStore
    from loraplex.workers.state.slot_images import SlotImage

log = logging.getLogger("loraplex.pool.durable")

CREATION_ONLY = -1  # the applied seq_id of a snapshot taken before the adapter's first step


def snapshot_path(blob_root: Path, tenant_id: str, model_id: str, version: int) -> Path:
    return blob_root / tenant_id / model_id / "snapshots" / f"v{version:08d}.safetensors"


@dataclass
class _Cadence:
    tenant_id: str
    last_at: float
    steps: int = 0  # optimizer steps since the last snapshot
    dirty: bool = False  # changed since the last snapshot


@dataclass
class _Job:
    model_id: str
    tenant_id: str
    applied_seq_id: int
    take: Callable[[], SlotImage] | None  # the state's host copy (writer thread); None: forget the adapter
    released: threading.Event = field(default_factory=threading.Event)
    files_written: Future[None] | None = None  # every sampler save's files handed in before this job


class Snapshotter:
    def __init__(
        self,
        store: AdapterStore,
        sessions: sessionmaker[Session],
        redis: redis_lib.Redis,
        *,
        pool: str,
        blob_root: Path,
        every_steps: int,
        every_s: float,
        keep: int = 2,
        lease: PoolLease | None = None,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[..., Any] = write_durable_snapshot,
        copy_budget_bytes: int = 4 << 30,
        writes: BackgroundWrites | None = None,
    ) -> None:
        """write: the file writer (workers/durable_snapshot.write_durable_snapshot; tests inject a failing one).
        copy_budget_bytes: the most adapter state taken but not yet written at once (device clones; at least one
        adapter is always taken). writes: the sampler saves' background file writes (a snapshot is recorded only after
        those handed in before it)."""
        self.writes = writes
        self.store = store
        self.sessions = sessions
        self.redis = redis
        self.pool = pool
        self.blob_root = blob_root
        self.every_steps = every_steps
        self.every_s = every_s
        self.keep = keep
        self.lease = lease
        self.clock = clock
        self._write = write
        self.copy_budget_bytes = copy_budget_bytes
        self._cadence: dict[str, _Cadence] = {}
        self._in_flight: set[str] = set()  # adapters with a job queued or being written (both threads: the lock)
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._stopping = threading.Event()
        self._warn = RateLimitedLog(log, every_s=10.0)
        self.written = 0  # snapshots recorded (tests and logs)
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    # ---- loop thread -------------------------------------------------------------------------------------------------
    def adopted(self, model_id: str, tenant_id: str, replayed_steps: int, changed: bool) -> None:
        """A restarted pool rebuilt this adapter (recovery.py); `changed`: requests were replayed on top of its
        snapshot (or it had none), so a new one is due by the usual rules."""
        self._cadence[model_id] = _Cadence(tenant_id, self.clock(), replayed_steps, changed)

    def hand_over(self, model_id: str, timeout_s: float = 60.0) -> None:
        """The adapter leaves this pool (pool/handoff.py): its snapshot being written, if any, is recorded first (every
        plan before is finished, so it is not held back), and its cadence is forgotten."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            with self._lock:
                if model_id not in self._in_flight:
                    break
            time.sleep(0.01)
        self._cadence.pop(model_id, None)

    def after_plan(self, plan: BatchPlan, progress: LoopProgress) -> None:
        now = self.clock()
        deleted: list[_Job] = []
        for r in plan.requests:
            if r.kind == RequestKind.DELETE_ADAPTER:
                if r.model_id not in self.store:  # it is gone: so go its snapshots
                    self._cadence.pop(r.model_id, None)
                    deleted.append(_Job(r.model_id, r.tenant_id, CREATION_ONLY, None))
                continue
            if not KINDS[r.kind].changes_state or (r.part is not None and r.unfinished):
                continue
            c = self._cadence.setdefault(r.model_id, _Cadence(r.tenant_id, now))
            c.dirty = True
            c.steps += r.kind == RequestKind.OPTIM_STEP
        due = [m for m, c in self._cadence.items() if c.dirty and self._is_due(c, now)]
        jobs = self._take(due, progress) + deleted
        if jobs:
            def release() -> None:
                for j in jobs:
                    j.released.set()

            progress.after_finished(release)
            self._after_writes(jobs)
            for job in jobs:
                self._jobs.put(job)

    def _after_writes(self, jobs: list[_Job]) -> None:
        if self.writes is not None:
            barrier = self.writes.barrier()
            for job in jobs:
                job.files_written = barrier

    def _is_due(self, c: _Cadence, now: float) -> bool:
        return (self.every_steps > 0 and c.steps >= self.every_steps) or (
            self.every_s > 0 and now - c.last_at >= self.every_s
        )

    def _take(self, model_ids: list[str], progress: LoopProgress | None, bounded: bool = True) -> list[_Job]:
        """These adapters' states as they are now (skipping those mid-request or still being written; bounded: no more
        than `copy_budget_bytes` taken and not yet written)."""
        busy = set(progress.in_parts) if progress is not None else set()
        with self._lock:
            busy |= self._in_flight
        jobs: list[_Job] = []
        with self._lock:
            room = max(1, self.copy_budget_bytes // self.store.stats.bytes_per_adapter) - len(self._in_flight)
        if not bounded:
            room = len(model_ids)
        for m in model_ids:
            if m in busy or m not in self.store:
                continue
            if len(jobs) >= room:  # the rest stay due: taken after the writer caught up
                break
            seq = progress.applied.get(m) if progress is not None else None
            c = self._cadence[m]
            try:
                copy = self.store.peek_async(m, self.copy_budget_bytes)
            except Exception as exc:  # noqa: BLE001 - this adapter is skipped now and tried again later
                self._warn.error("pool %s: cannot copy %s for a snapshot (%s)", self.pool, m, exc)
                continue
            jobs.append(_Job(m, c.tenant_id, CREATION_ONLY if seq is None else seq, copy))
            c.steps, c.dirty, c.last_at = 0, False, self.clock()
            with self._lock:
                self._in_flight.add(m)
        return jobs

    def flush(self, progress: LoopProgress | None, timeout_s: float = 120.0) -> None:
        """A clean stop, after the last plan was finished: snapshot every changed adapter, wait for the writer."""
        # Unbounded: training is over (no activations), and every changed adapter must reach the disk now.
        jobs = self._take([m for m, c in self._cadence.items() if c.dirty], progress, bounded=False)
        self._after_writes(jobs)
        for job in jobs:
            job.released.set()  # every plan is finished: nothing to wait for
            self._jobs.put(job)
        self.close(timeout_s)
        if jobs:
            log.info("pool %s: wrote %d adapter snapshots at shutdown", self.pool, len(jobs))

    def close(self, timeout_s: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self._stopping.set()

    # ---- writer thread -----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job.take is None:
                    self._forget(job)
                else:
                    self._write_one(job)
            except LeaseLostError as exc:
                log.error("pool %s: snapshot of %s not recorded: %s", self.pool, job.model_id, exc)
            except Exception as exc:  # noqa: BLE001 - the pool keeps training; the previous snapshot stays valid
                self._warn.error("pool %s: snapshot of %s failed (%s: %s); the previous one stays in use",
                                 self.pool, job.model_id, type(exc).__name__, exc)  # fmt: skip
                self._redo(job)
            finally:
                with self._lock:
                    self._in_flight.discard(job.model_id)

    def _redo(self, job: _Job) -> None:
        """A failed write: the adapter is due again at the next plan that touches it (or at shutdown)."""
        c = self._cadence.get(job.model_id)
        if c is not None:
            c.dirty = True
            c.steps = max(c.steps, self.every_steps)

    def _wait_released(self, job: _Job) -> bool:
        while not job.released.wait(0.5):
            if self._stopping.is_set():
                return False
        while job.files_written is not None:
            try:
                job.files_written.result(timeout=0.5)
                return True
            except FutureTimeout:
                if self._stopping.is_set():
                    return False
        return True

    def _write_one(self, job: _Job) -> None:
        assert job.take is not None
        image = job.take()
        with self.sessions() as session:
            version = SnapshotRepository(session).next_version(job.model_id)
        path = snapshot_path(self.blob_root, job.tenant_id, job.model_id, version)
        written = self._write(path, image, version=version, applied_seq_id=job.applied_seq_id)
        if not self._wait_released(job):
            path.unlink(missing_ok=True)
            return
        with unit_of_work(self.sessions) as session:
            check_leader(session, self.pool, self.lease)
            if not live_status(session, job.model_id):  # deleted (or failed) meanwhile
                path.unlink(missing_ok=True)
                return
            repo = SnapshotRepository(session)
            repo.add(job.model_id, self.pool, version, job.applied_seq_id, image.step, str(path),
                     written.sha256, written.size_bytes)  # fmt: skip
            dropped = repo.prune(job.model_id, self.keep)
            kept = repo.newest_first(job.model_id)
        if len(kept) >= 2:  # the log keeps what the one before this needs
            replay_log.trim(self.redis, self.pool, job.model_id, kept[1].applied_seq_id)
        for old in dropped:
            Path(old).unlink(missing_ok=True)
        self.written += 1
        log.info("pool %s: snapshot v%d of %s (seq_id %d, step %d)", self.pool, version, job.model_id,
                 job.applied_seq_id, image.step)  # fmt: skip

    def _forget(self, job: _Job) -> None:
        if not self._wait_released(job):
            return
        with unit_of_work(self.sessions) as session:
            check_leader(session, self.pool, self.lease)
            paths = SnapshotRepository(session).forget(job.model_id)
        for p in paths:
            Path(p).unlink(missing_ok=True)


def build_snapshotter(
    settings: Any, store: AdapterStore, sessions: Any, redis: Any, lease: Any, writes: BackgroundWrites | None = None
) -> Snapshotter:
    return Snapshotter(
        store, sessions, redis, pool=settings.pool, blob_root=settings.resolved_blob_root,
        every_steps=settings.snapshot_every_steps, every_s=settings.snapshot_every_seconds,
        keep=settings.snapshot_keep, lease=lease, writes=writes,
    )  # fmt: skip

