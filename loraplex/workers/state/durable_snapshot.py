"""A durable adapter snapshot on disk: the spill file format (spill_format.py: the slot's four rows, i.e. weights,
unconsumed gradients, Adam exp_avg and exp_avg_sq, plus step count, rank, alpha, seed, target modules and the pool
signature) with two more metadata fields, `snapshot_version` and `applied_seq_id` (every request of the adapter up to
it is in the rows). Written atomically and fsynced (fsutil.atomic_write); the sha256 of the whole file is returned
and recorded with it (SQL), and checked before a restarting pool loads it: a file that does not match is never loaded.

Torch and the stdlib only: the pool's snapshot writer (pool/durable/snapshotter.py) calls these from its thread.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.errors import CorruptSnapshotError, InvalidRequestError
from loraplex.runtime.fsutil import private_dirs
from loraplex.workers.state.slot_images import ROWS, SlotImage
from loraplex.workers.state.spill_format import read_raw_metadata, read_spill, write_spill

HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class WrittenSnapshot:
    path: Path
    sha256: str
    size_bytes: int


def write_durable_snapshot(path: Path, image: SlotImage, *, version: int, applied_seq_id: int) -> WrittenSnapshot:
    """Write (atomically: a failure, e.g. a full disk, leaves no file and raises) and return its hash and size."""
    extra = {"snapshot_version": str(version), "applied_seq_id": str(applied_seq_id)}
    private_dirs(path.parent)  # owner-only, as the file (fsutil.atomic_write)
    digest = write_spill(path, image, extra)
    return WrittenSnapshot(path, digest, path.stat().st_size)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_durable_snapshot(path: Path, sha256: str, width: int) -> tuple[SlotImage, int]:
    """The snapshot's slot image and the applied seq_id it covers, after checking the whole file against `sha256`;
    CorruptSnapshotError when it is missing, does not match, or is not a snapshot file of this layout (`width`)."""
    try:
        actual = file_sha256(path)
    except OSError as exc:
        raise CorruptSnapshotError(f"snapshot {path} cannot be read: {exc}") from exc
    if actual != sha256:
        raise CorruptSnapshotError(f"snapshot {path} fails its hash check (sha256 {actual[:12]}..., recorded {sha256[:12]}...)")
    try:
        meta = read_raw_metadata(path)
        out = torch.empty((len(ROWS), width))
        image = read_spill(path, out)
        return image, int(meta["applied_seq_id"])
    except (OSError, ValueError, KeyError, InvalidRequestError) as exc:
        raise CorruptSnapshotError(f"snapshot {path} is not a snapshot file of this pool: {exc}") from exc
