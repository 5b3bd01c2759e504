"""`pools.draining`: an operator drained the pool (`loraplex pool drain`): its adapters moved to sibling pools and
placement gives it no new adapter until it is undrained. Existing rows: not draining.

Revision ID: 0011_pool_draining
Revises: 0010_adapter_pool
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_pool_draining"
down_revision: str | None = "0010_adapter_pool"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("draining")
