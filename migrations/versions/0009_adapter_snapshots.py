"""`adapter_snapshots`: each adapter's durable training-state snapshots (file path, content hash, the applied seq_id
they cover), written by the pool at a cadence; a restarted pool adopts the newest valid one (loraplex/durable/).

Revision ID: 0009_adapter_snapshots
Revises: 0008_pipelines
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_adapter_snapshots"
down_revision: str | None = "0008_pipelines"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_snapshots",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_id", sa.String(128), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("applied_seq_id", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_snapshots"),
        sa.ForeignKeyConstraint(
            ["model_id"], ["adapters.model_id"], name="fk_adapter_snapshots_model_id_adapters", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("model_id", "version", name="uq_adapter_snapshots_model_id_version"),
    )
    op.create_index("ix_adapter_snapshots_pool_model_id", "adapter_snapshots", ["pool", "model_id"])


def downgrade() -> None:
    op.drop_index("ix_adapter_snapshots_pool_model_id", table_name="adapter_snapshots")
    op.drop_table("adapter_snapshots")
