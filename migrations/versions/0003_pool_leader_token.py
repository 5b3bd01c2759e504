"""`pools.leader_token`: the fencing token of the pool process that leads the pool (one leader per pool: its lease in
Redis, queue/lease.py). The new leader writes it when it takes over; every plan's record transaction checks it.

Revision ID: 0003_pool_leader_token
Revises: 0002_residency
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_pool_leader_token"
down_revision: str | None = "0002_residency"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.add_column(sa.Column("leader_token", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("leader_token")
