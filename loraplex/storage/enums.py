"""States stored in the database. Persisted as their string values (never as native DB enums), so SQLite and PostgreSQL match."""

from __future__ import annotations

from enum import StrEnum

from loraplex.protocol.checkpoint_paths import (
    CheckpointKind,  # the one vocabulary of checkpoint kinds, stored by value here
)

__all__ = ["AdapterStatus", "CheckpointKind", "PipelineState", "PoolState", "ResidencyTier", "TenantState"]


class AdapterStatus(StrEnum):
    CREATING = "creating"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class ResidencyTier(StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


class PoolState(StrEnum):
    """A pool process's life (`pools.state`): LOADING from its start until its engine is built and the dispatcher
    reads, READY while it serves, STOPPED after a clean shutdown. A crash leaves the last state: the heartbeat's age
    tells it apart."""

    LOADING = "loading"
    READY = "ready"
    STOPPED = "stopped"


class PipelineState(StrEnum):
    """An offline fine-tuning pipeline (`pipelines.state`): QUEUED until a Celery worker takes it, RUNNING while it
    trains (also while a resumed run continues from its last checkpoint), then one of the three ends. CANCELLED is
    also the flag a running pipeline checks between steps."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (PipelineState.SUCCEEDED, PipelineState.FAILED, PipelineState.CANCELLED)


class TenantState(StrEnum):
    """What an operator lets a tenant do (`tenants.state`, service/tenant_controls.py): ACTIVE is served; SUSPENDED
    gets 403 on every authenticated call; DRAINING gets 403 on calls that would queue new work, while its queued
    requests run and their futures stay readable."""

    ACTIVE = "active"
    SUSPENDED = "suspended"
    DRAINING = "draining"
