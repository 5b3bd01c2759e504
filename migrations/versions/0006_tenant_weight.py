"""`tenants.weight`: each tenant's fair-share weight (dispatch/fair_share.py: a backlogged tenant of weight 2 gets twice
the training tokens of one of weight 1). Existing tenants read 1, the weight everyone had.

(Another branch may add a 0006 of its own: the later one to merge renumbers to 0007 and revises this one.)

Revision ID: 0006_tenant_weight
Revises: 0005_sampling_sessions
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_tenant_weight"
down_revision: str | None = "0005_sampling_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
