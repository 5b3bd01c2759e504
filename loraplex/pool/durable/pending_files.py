"""Sampler checkpoints answered before their files were written (pool/finish.py), after the pool died in between.

Such a save's row holds FILES_PENDING instead of a hash, and the save itself is in the adapter's request log (it was
acked when answered). A snapshot is recorded only after every sampler file handed to the writer before it is written
(pool/durable/snapshotter.py), so a row still pending after a crash either has its files complete on disk (the pool
died between writing them and settling the row) or its save lies after the adapter's newest snapshot, in the log
that recovery replays (pool/durable/recovery.py). There, on reaching the last logged save of a pending row, the
adapter's state is exactly the state the save froze (the snapshot's state plus the same requests, one at a time), so
running the save again writes the same weights, bit for bit, and freezes the same sampler copy; the row is settled.

The bit-for-bit claim has the condition recovery itself has: plans that held one adapter's step at a time (mixed
plans' float sums may differ in the last bits from the replay's, DESIGN Durability). What cannot be rebuilt (the save
not in the log: the request log was off, or Redis lost it) is logged and the row stays pending (a sample of it then
fails with the folder's NotFoundError)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from loraplex.errors import LoraplexError
from loraplex.protocol import BatchPlan, PlannedRequest, Step, StepKind
from loraplex.protocol.checkpoint_files import MANIFEST_FILE, read_folder
from loraplex.protocol.results import SaveResult
from loraplex.storage.enums import CheckpointKind
from loraplex.storage.repositories import CheckpointRepository, unit_of_work

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from loraplex.protocol import Executor
    from loraplex.runtime.background_writes import BackgroundWrites

log = logging.getLogger("loraplex.pool.durable")


@dataclass(frozen=True)
class PendingRow:
    row_id: str
    name: str
    step: int
    directory: Path


def pending_rows(sessions: sessionmaker[Session], tenant_id: str, model_id: str) -> dict[str, PendingRow]:
    """The adapter's sampler checkpoints whose files were never settled, by name."""
    with sessions() as session:
        rows = CheckpointRepository(session, tenant_id).pending(model_id)
        return {
            c.name: PendingRow(c.id, c.name, c.step, Path(unquote(urlparse(c.blob_uri).path)))
            for c in rows
            if CheckpointKind(c.kind) == CheckpointKind.SAMPLER
        }


def complete_files(row: PendingRow) -> tuple[int, str] | None:
    """(size, sha256 of the manifest) of the row's folder when it holds a whole, verified checkpoint of the row's
    step (not an older save of the same name); None otherwise."""
    try:
        manifest, blobs = read_folder(row.directory)
    except LoraplexError:
        return None
    if manifest.get("step") != row.step:
        return None
    manifest_bytes = (row.directory / MANIFEST_FILE).read_bytes()
    return sum(len(b) for b in blobs.values()) + len(manifest_bytes), hashlib.sha256(manifest_bytes).hexdigest()


def settle(sessions: sessionmaker[Session], tenant_id: str, row: PendingRow, files: tuple[int, str]) -> None:
    with unit_of_work(sessions) as session:
        CheckpointRepository(session, tenant_id).settle(row.row_id, files[0], files[1])


def write_again(
    request: PlannedRequest, executor: Executor, writes: BackgroundWrites | None
) -> tuple[int, str] | None:
    """Run a logged sampler save again on the state replayed up to it: its files written (waited for) and its sampler
    copy frozen. None (logged) when it fails."""
    outcome = executor.execute(BatchPlan((Step(StepKind.CHECKPOINT, (request,)),)))
    if not outcome or not outcome[0].ok or not isinstance(outcome[0].result, SaveResult):
        log.error("adapter %s: writing the files of its answered save %s again failed (%s)", request.model_id,
                  request.request_id, outcome[0].error if outcome else "no outcome")  # fmt: skip
        return None
    result = outcome[0].result
    files: dict[str, Any]
    if result.sha256 is not None:
        files = {"size_bytes": result.size_bytes, "sha256": result.sha256}
    elif writes is not None and writes.pending(request.request_id):
        try:
            files = writes.take(request.request_id)
        except Exception:  # noqa: BLE001 - a full disk...: the row stays pending
            log.exception("adapter %s: writing the files of its answered save %s again failed", request.model_id,
                          request.request_id)  # fmt: skip
            return None
    else:
        return None
    return int(files["size_bytes"]), str(files["sha256"])
