"""Rename `snapshots` to `residency`: the table records WHERE each rank keeps an adapter's live state (GPU slot, pinned
CPU or a spill file), while "snapshot" names that state itself (workers/snapshots.AdapterSnapshot). A new table with
its own constraint and index names, the rows copied over, the old one dropped (SQLite cannot rename constraints).

Revision ID: 0002_residency
Revises: 0001_initial
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_residency"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = "model_id, pool, rank, tier, slot, location, updated_at"


def _create(table: str) -> None:
    op.create_table(
        table,
        sa.Column("model_id", sa.String(128), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=True),
        sa.Column("location", sa.String(1024), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_id", "pool", "rank", name=f"pk_{table}"),
        sa.ForeignKeyConstraint(
            ["model_id"], ["adapters.model_id"], name=f"fk_{table}_model_id_adapters", ondelete="CASCADE"
        ),
    )
    op.create_index(f"ix_{table}_pool_rank", table, ["pool", "rank"])


def _move(source: str, target: str) -> None:
    _create(target)
    op.execute(f"INSERT INTO {target} ({_COLUMNS}) SELECT {_COLUMNS} FROM {source}")
    op.drop_index(f"ix_{source}_pool_rank", table_name=source)
    op.drop_table(source)


def upgrade() -> None:
    _move("snapshots", "residency")


def downgrade() -> None:
    _move("residency", "snapshots")
