"""plan families: jobs over ranges of input sizes (plans.family, family_plans)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("family", sa.JSON(), nullable=True))
    op.create_table(
        "family_plans",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("size", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("origin", sa.String(length=255), nullable=False),
        sa.Column("predicted_ms", sa.Float(), nullable=False),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("hits", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "size"),
    )


def downgrade() -> None:
    op.drop_table("family_plans")
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("family")
