"""`pools.state`: what the pool is doing (loading its base model, ready, stopped), so `/v1/healthz` and the futures
route can tell a pool that beats but has not loaded its model yet from one that serves. Existing rows (and a pool of an
older build that never writes it) read `ready`: their heartbeat alone decides, as before.

Revision ID: 0004_pool_state
Revises: 0003_pool_leader_token
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_pool_state"
down_revision: str | None = "0003_pool_leader_token"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("pools", sa.Column("state", sa.String(16), nullable=False, server_default="ready"))


def downgrade() -> None:
    with op.batch_alter_table("pools") as batch:
        batch.drop_column("state")
