"""dashboard: a job's progress history (job_progress), the baselines beside a plan

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_progress",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("elapsed_s", sa.Float(), nullable=False),
        sa.Column("incumbent_ms", sa.Float(), nullable=True),
        sa.Column("bound_ms", sa.Float(), nullable=True),
        sa.Column("gap", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_job_progress_job_id", "job_progress", ["job_id"])
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("baselines", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("baselines")
    op.drop_index("ix_job_progress_job_id", table_name="job_progress")
    op.drop_table("job_progress")
