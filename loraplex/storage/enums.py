"""States stored in the database. Persisted as their string values (never as native DB enums), so SQLite and PostgreSQL match."""

from __future__ import annotations

from enum import StrEnum


class AdapterStatus(StrEnum):
    CREATING = "creating"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class CheckpointKind(StrEnum):
    STATE = "state"  # weights + optimizer state (save_state / save_weights)
    SAMPLER = "sampler"  # weights only, for sampling (save_weights_for_sampler)
    EXPORT = "export"  # PEFT-format export


class SnapshotTier(StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"
