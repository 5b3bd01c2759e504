"""Repositories: the only code that writes SQL. Tenant data is always reached through a repository bound to a tenant.

Write methods flush but never commit; wrap them in `unit_of_work` (loraplex.storage.db's, importable from here too)."""

from loraplex.storage.db import unit_of_work
from loraplex.storage.repositories.adapters import AdapterRepository
from loraplex.storage.repositories.admins import AdminRepository
from loraplex.storage.repositories.audit import AuditRepository
from loraplex.storage.repositories.checkpoints import CheckpointRepository
from loraplex.storage.repositories.pipelines import PipelineRepository, pipeline_tenant, pipelines_missing_export
from loraplex.storage.repositories.pools import PoolRepository
from loraplex.storage.repositories.residency import ResidencyRepository
from loraplex.storage.repositories.samplers import SamplerRepository
from loraplex.storage.repositories.sessions import SessionRepository, idle_sessions
from loraplex.storage.repositories.snapshots import SnapshotInfo, SnapshotRepository
from loraplex.storage.repositories.tenants import API_KEY_PREFIX, TenantRepository, hash_api_key, new_api_key
from loraplex.storage.repositories.usage import KindTotals, UsageRepository, UsageTotals

__all__ = [
    "API_KEY_PREFIX",
    "AdapterRepository",
    "AdminRepository",
    "AuditRepository",
    "CheckpointRepository",
    "KindTotals",
    "PipelineRepository",
    "PoolRepository",
    "SessionRepository",
    "SnapshotInfo",
    "SnapshotRepository",
    "ResidencyRepository",
    "SamplerRepository",
    "TenantRepository",
    "UsageRepository",
    "UsageTotals",
    "hash_api_key",
    "idle_sessions",
    "new_api_key",
    "pipeline_tenant",
    "pipelines_missing_export",
    "unit_of_work",
]
