"""`sampling_sessions`: what each sampler samples from (a sampler checkpoint's tinker path, or the base model), per
tenant; unique per (client session, sampling_session_seq_id), the Tinker SDK's key for creating one.

Revision ID: 0005_sampling_sessions
Revises: 0004_pool_state
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_sampling_sessions"
down_revision: str | None = "0004_pool_state"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sampling_sessions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=True),
        sa.Column("sampling_session_seq_id", sa.BigInteger(), nullable=True),
        sa.Column("base_model", sa.String(255), nullable=False),
        sa.Column("model_path", sa.String(1024), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sampling_sessions"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_sampling_sessions_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.UniqueConstraint(
            "session_id", "sampling_session_seq_id", name="uq_sampling_sessions_session_id_sampling_session_seq_id"
        ),
    )
    op.create_index("ix_sampling_sessions_tenant_id", "sampling_sessions", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_sampling_sessions_tenant_id", table_name="sampling_sessions")
    op.drop_table("sampling_sessions")
