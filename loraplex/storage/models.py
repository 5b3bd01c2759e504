"""ORM models: one class per table. Every schema change here needs a migration in `migrations/versions/`
(tests/integration/test_migrations.py fails when the two disagree)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from loraplex.storage.enums import AdapterStatus, CheckpointKind, PipelineState, PoolState, ResidencyTier, TenantState
from loraplex.storage.types import UTCDateTime, str_enum, utcnow

# The enums are public here too: callers reading a model's fields import them from here.
__all__ = [
    "Adapter",
    "AdminAuditEntry",
    "AdapterSnapshotRow",
    "AdapterStatus",
    "ApiKey",
    "Base",
    "Checkpoint",
    "CheckpointKind",
    "Pipeline",
    "PipelineState",
    "Pool",
    "PoolState",
    "Residency",
    "ResidencyTier",
    "SamplingSession",
    "Tenant",
    "TenantState",
    "TrainingSession",
    "Usage",
]

# Deterministic constraint names: Alembic needs names to drop/alter constraints (SQLite batch mode especially).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 36  # str(uuid4())
MODEL_ID_LENGTH = 128  # Tinker ids look like "<session uuid>:train:<n>"


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Fair-share weight (migration 0006): a backlogged tenant of weight 2 gets twice the training tokens of one of
    # weight 1 (dispatch/fair_share.py); the pool reads it through dispatch/tenant_weights.py.
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    # What an operator lets it do (migration 0012; service/tenant_controls.py), why, and since when.
    state: Mapped[TenantState] = mapped_column(
        str_enum(TenantState), default=TenantState.ACTIVE, server_default=TenantState.ACTIVE.value
    )
    state_reason: Mapped[str | None] = mapped_column(String(255))
    state_changed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Its own quotas (migration 0012); NULL: the setting's (LORAPLEX_MAX_QUEUED_REQUESTS_PER_TENANT, ...); 0: none.
    max_queued_requests: Mapped[int | None] = mapped_column(Integer)
    max_queued_tokens: Mapped[int | None] = mapped_column(BigInteger)
    max_adapters: Mapped[int | None] = mapped_column(Integer)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # sha256 hex of the whole key; the plaintext is shown once at issue time and never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(8))  # for display only ("tml-AbCd")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Migration 0012: a label the operator gives at issue time, and when the gateway last authenticated it (written
    # at most once a minute per key: service/tenant_auth.py).
    name: Mapped[str | None] = mapped_column(String(64))
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Read-only, loaded only when asked (the admin's lists name the tenant): writes go through tenant_id.
    tenant: Mapped[Tenant] = relationship(viewonly=True, lazy="raise")


class Adapter(Base):
    __tablename__ = "adapters"

    model_id: Mapped[str] = mapped_column(String(MODEL_ID_LENGTH), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(255))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[AdapterStatus] = mapped_column(str_enum(AdapterStatus), default=AdapterStatus.CREATING)
    # Highest seq_id whose effect is in the weights; a restarted pool resumes after it.
    applied_seq_id: Mapped[int | None] = mapped_column(BigInteger)
    # The Tinker session that created it (not a foreign key: adapters outlive session rows being pruned).
    session_id: Mapped[str | None] = mapped_column(String(64), index=True)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # The pool it is placed on (service/placement.py; migration 0010): its requests go to that pool's queue. NULL
    # (rows from before the fleet): the gateway's own pool, settings.pool.
    pool: Mapped[str | None] = mapped_column(String(64), index=True)
    # Read-only, loaded only when asked (the admin's lists name the tenant): writes go through tenant_id.
    tenant: Mapped[Tenant] = relationship(viewonly=True, lazy="raise")


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("model_id", "kind", "name"),
        Index("ix_checkpoints_tenant_id_model_id", "tenant_id", "model_id"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("adapters.model_id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    kind: Mapped[CheckpointKind] = mapped_column(str_enum(CheckpointKind))
    name: Mapped[str] = mapped_column(String(255))
    blob_uri: Mapped[str] = mapped_column(String(1024))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Read-only, loaded only when asked (the admin's lists name the tenant): writes go through tenant_id.
    tenant: Mapped[Tenant] = relationship(viewonly=True, lazy="raise")


class AdapterSnapshotRow(Base):
    """One durable snapshot of an adapter's whole training state (weights, unconsumed gradients, Adam moments, step,
    hyperparameters) written by a pool (loraplex/durable/), covering every request up to `applied_seq_id`. A pool
    restarts from the newest one whose file matches `sha256` and replays the request log after it. Migration 0009."""

    __tablename__ = "adapter_snapshots"
    __table_args__ = (
        UniqueConstraint("model_id", "version"),
        Index("ix_adapter_snapshots_pool_model_id", "pool", "model_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("adapters.model_id", ondelete="CASCADE"))
    pool: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(BigInteger)  # 1, 2, ... per adapter
    applied_seq_id: Mapped[int] = mapped_column(BigInteger)  # -1: only the creation (no step yet)
    step: Mapped[int] = mapped_column(BigInteger)  # the Adam step count inside
    path: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64))  # of the whole file
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Residency(Base):
    """Where one rank of one pool keeps an adapter's live state (GPU slot, pinned CPU, or a file on disk)."""

    __tablename__ = "residency"
    __table_args__ = (Index("ix_residency_pool_rank", "pool", "rank"),)

    model_id: Mapped[str] = mapped_column(ForeignKey("adapters.model_id", ondelete="CASCADE"), primary_key=True)
    pool: Mapped[str] = mapped_column(String(64), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    tier: Mapped[ResidencyTier] = mapped_column(str_enum(ResidencyTier))
    slot: Mapped[int | None] = mapped_column(Integer)
    location: Mapped[str | None] = mapped_column(String(1024))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class Pool(Base):
    __tablename__ = "pools"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(255))
    world_size: Mapped[int] = mapped_column(Integer)
    slots: Mapped[int] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The fencing token of the pool process that leads the pool (its Redis lease, queue/lease.py): written when it
    # takes over, checked by every plan's record transaction, so a deposed leader's records are refused.
    leader_token: Mapped[int | None] = mapped_column(BigInteger)
    # PoolState value (migration 0004); rows of an older pool build read "ready" and their heartbeat alone decides.
    state: Mapped[PoolState] = mapped_column(
        str_enum(PoolState), default=PoolState.READY, server_default=PoolState.READY.value
    )
    # Drained by an operator (migration 0011): placement gives it no new adapter until it is undrained.
    draining: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class TrainingSession(Base):
    """A client session (Tinker `create_session`): groups a run's adapters and carries its heartbeat."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finish_reason: Mapped[str | None] = mapped_column(String(255))


class SamplingSession(Base):
    """A sampler (Tinker `create_sampling_session`, or the unnamed save_weights_for_sampler): what sampling requests
    of its id sample from, a sampler checkpoint of the tenant (its tinker path) or the bare base model (None)."""

    __tablename__ = "sampling_sessions"
    __table_args__ = (UniqueConstraint("session_id", "sampling_session_seq_id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # The client session and its per-session counter (the SDK's idempotency key for creating it); None for the unnamed
    # form, which the save names.
    session_id: Mapped[str | None] = mapped_column(String(64))
    sampling_session_seq_id: Mapped[int | None] = mapped_column(BigInteger)
    base_model: Mapped[str] = mapped_column(String(255))
    model_path: Mapped[str | None] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Usage(Base):
    """One metered request (the kinds whose KINDS row has counts_usage: forward_backward, forward). Append-only; kept
    after the adapter is deleted."""

    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model_id: Mapped[str | None] = mapped_column(String(MODEL_ID_LENGTH))
    kind: Mapped[str] = mapped_column(String(32))
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Read-only, loaded only when asked (the admin's lists name the tenant): writes go through tenant_id.
    tenant: Mapped[Tenant] = relationship(viewonly=True, lazy="raise")


class AdminAccount(Base):
    """An operator of the web admin (loraplex/admin/), created from the CLI; never a tenant. The password is kept as a
    salted scrypt hash (loraplex/admin/passwords.py); repeated failures lock the account for a while."""

    __tablename__ = "admin_accounts"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    username: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    failed_logins: Mapped[int] = mapped_column(Integer, default=0)
    locked_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Bumped on password change or unlock: a session cookie carries the version it was issued under.
    session_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_login_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Pipeline(Base):
    """An offline fine-tuning pipeline (loraplex/pipelines/): its config, where its dataset lies, and its progress,
    written by the Celery task that drives it through the service layer. A sweep's points share a `sweep_id`."""

    __tablename__ = "pipelines"
    __table_args__ = (Index("ix_pipelines_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    sweep_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), index=True)
    # The grid values of this sweep point, e.g. {"lora.rank": 8, "optimizer.learning_rate": 0.001}; {} outside sweeps.
    sweep_point: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Blob key of the folder holding train.jsonl (and eval.jsonl) as the tenant uploaded them.
    dataset_key: Mapped[str] = mapped_column(String(1024))
    state: Mapped[PipelineState] = mapped_column(str_enum(PipelineState), default=PipelineState.QUEUED)
    step: Mapped[int] = mapped_column(BigInteger, default=0)  # optimizer steps done
    total_steps: Mapped[int] = mapped_column(BigInteger)
    # Runs of the Celery task that took it (1 = never interrupted); each run trains its own adapter, `model_id`.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    model_id: Mapped[str | None] = mapped_column(String(MODEL_ID_LENGTH))
    last_checkpoint: Mapped[str | None] = mapped_column(String(1024))  # tinker path of the latest save_state
    last_checkpoint_step: Mapped[int | None] = mapped_column(BigInteger)
    eval_losses: Mapped[list[list[float]]] = mapped_column(JSON, default=list)  # [[step, loss], ...]
    train_losses: Mapped[list[list[float]]] = mapped_column(JSON, default=list)  # [[step, loss], ...]
    final_checkpoint: Mapped[str | None] = mapped_column(String(1024))  # tinker path of the final sampler weights
    export_path: Mapped[str | None] = mapped_column(String(1024))  # the PEFT folder written at the end
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    # Read-only, loaded only when asked (the admin's lists name the tenant): writes go through tenant_id.
    tenant: Mapped[Tenant] = relationship(viewonly=True, lazy="raise")


class AdminAuditEntry(Base):
    """One action an operator took in the web admin (migration 0012): who, what, on which row, when, and its
    parameters. Append-only; written in the action's own transaction where the action is one (service/audit.py)."""

    __tablename__ = "admin_audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(64))  # the admin account's username
    action: Mapped[str] = mapped_column(String(64))
    target_kind: Mapped[str] = mapped_column(String(32))  # tenant, api key, adapter, checkpoint, pipeline
    target_id: Mapped[str] = mapped_column(String(MODEL_ID_LENGTH))
    target_name: Mapped[str | None] = mapped_column(String(255))  # readable: the tenant's name, a key's prefix...
    detail: Mapped[str | None] = mapped_column(Text)
