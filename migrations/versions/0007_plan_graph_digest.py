"""plans.graph_digest: the graph a stored plan was made for, so later jobs start from it

Filled from each plan document's ``graph`` record (plans stored since plans recorded
their graph); plans without one keep it empty and are not offered to later jobs.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 23:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

plans = sa.table(
    "plans",
    sa.column("job_id", sa.String),
    sa.column("document", sa.JSON),
    sa.column("graph_digest", sa.String),
)


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("graph_digest", sa.String(length=64), nullable=True))
        batch.create_index("ix_plans_graph_digest", ["graph_digest"])
    connection = op.get_bind()
    rows = connection.execute(sa.select(plans.c.job_id, plans.c.document)).all()
    for job_id, document in rows:
        graph = document.get("graph") if isinstance(document, dict) else None
        digest = graph.get("digest") if isinstance(graph, dict) else None
        if isinstance(digest, str) and len(digest) <= 64:
            update = plans.update().where(plans.c.job_id == job_id).values(graph_digest=digest)
            connection.execute(update)


def downgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.drop_index("ix_plans_graph_digest")
        batch.drop_column("graph_digest")
