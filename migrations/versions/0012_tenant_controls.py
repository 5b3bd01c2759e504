"""Operator controls (service/tenant_controls.py): a tenant's state (active, suspended, draining), its reason and
time, and its own queue and adapter quotas (NULL: the settings'); an API key's name and last use; and the admin's
audit log, `admin_audit`. Existing tenants read active with the settings' quotas; existing keys have no name and no
recorded use.

Revision ID: 0012_tenant_controls
Revises: 0011_pool_draining
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_tenant_controls"
down_revision: str | None = "0011_pool_draining"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TENANT_COLUMNS = ("state", "state_reason", "state_changed_at", "max_queued_requests", "max_queued_tokens", "max_adapters")
KEY_COLUMNS = ("name", "last_used_at")


def upgrade() -> None:
    op.add_column("tenants", sa.Column("state", sa.String(16), nullable=False, server_default="active"))
    op.add_column("tenants", sa.Column("state_reason", sa.String(length=255), nullable=True))
    op.add_column("tenants", sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("tenants", sa.Column("max_queued_requests", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("max_queued_tokens", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("max_adapters", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("name", sa.String(length=64), nullable=True))
    op.add_column("api_keys", sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "admin_audit",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target_kind", sa.String(length=32), nullable=False),
        sa.Column("target_id", sa.String(length=128), nullable=False),
        sa.Column("target_name", sa.String(length=255), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_audit")),
    )
    op.create_index(op.f("ix_admin_audit_created_at"), "admin_audit", ["created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_admin_audit_created_at"), table_name="admin_audit")
    op.drop_table("admin_audit")
    with op.batch_alter_table("api_keys") as batch:
        for column in KEY_COLUMNS:
            batch.drop_column(column)
    with op.batch_alter_table("tenants") as batch:
        for column in TENANT_COLUMNS:
            batch.drop_column(column)
