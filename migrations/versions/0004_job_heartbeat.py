"""jobs: a lease (heartbeat_at, worker), so that jobs whose worker or message was lost
are taken back (workers/sweeper.py)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("worker", sa.String(length=255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("worker")
        batch.drop_column("heartbeat_at")
