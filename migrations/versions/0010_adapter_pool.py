"""`adapters.pool`: the pool of the fleet an adapter is placed on when it is created (service/placement.py); every
request of the adapter goes to that pool's queue. Existing rows stay NULL: they belong to the one pool a deployment had
before, the gateway's own (settings.pool).

Revision ID: 0010_adapter_pool
Revises: 0009_adapter_snapshots
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_adapter_pool"
down_revision: str | None = "0009_adapter_snapshots"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("pool", sa.String(64), nullable=True))
    op.create_index("ix_adapters_pool", "adapters", ["pool"])


def downgrade() -> None:
    op.drop_index("ix_adapters_pool", table_name="adapters")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("pool")
