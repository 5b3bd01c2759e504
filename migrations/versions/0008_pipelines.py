"""`pipelines`: offline fine-tuning pipelines (loraplex/pipelines/): config, dataset blob key, state, progress
(step / total steps, last checkpoint, eval and train losses), final checkpoint and export, error; per tenant, sweep
points grouped by sweep_id.

Revision ID: 0008_pipelines
Revises: 0007_admin_accounts
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_pipelines"
down_revision: str | None = "0007_admin_accounts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pipelines",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("tenant_id", sa.String(36), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("sweep_id", sa.String(36), nullable=True),
        sa.Column("sweep_point", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("dataset_key", sa.String(1024), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("total_steps", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.String(128), nullable=True),
        sa.Column("last_checkpoint", sa.String(1024), nullable=True),
        sa.Column("last_checkpoint_step", sa.BigInteger(), nullable=True),
        sa.Column("eval_losses", sa.JSON(), nullable=False),
        sa.Column("train_losses", sa.JSON(), nullable=False),
        sa.Column("final_checkpoint", sa.String(1024), nullable=True),
        sa.Column("export_path", sa.String(1024), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pipelines"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_pipelines_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_pipelines_sweep_id", "pipelines", ["sweep_id"])
    op.create_index("ix_pipelines_tenant_id_created_at", "pipelines", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_pipelines_tenant_id_created_at", table_name="pipelines")
    op.drop_index("ix_pipelines_sweep_id", table_name="pipelines")
    op.drop_table("pipelines")
