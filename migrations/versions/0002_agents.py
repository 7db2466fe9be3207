"""node agents: unique node names, task leases' progress, errors and keys, profile specs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("version", sa.String(length=64), nullable=True))
        batch.create_unique_constraint("uq_nodes_name", ["name"])
    with op.batch_alter_table("agent_tasks") as batch:
        batch.add_column(sa.Column("key", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("progress", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch.add_column(sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_agent_tasks_key", ["key"])
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("spec", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("spec")
    with op.batch_alter_table("agent_tasks") as batch:
        batch.drop_index("ix_agent_tasks_key")
        batch.drop_column("finished_at")
        batch.drop_column("error")
        batch.drop_column("progress")
        batch.drop_column("key")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_constraint("uq_nodes_name", type_="unique")
        batch.drop_column("version")
