"""jobs: attention is fused by default; jobs stored before keep planning it unfused

A job's spec is stored with its defaults filled in, so a spec without ``fuse_attention``
was stored before the field existed, when every graph was unfused. Writing ``false`` into
those specs keeps their meaning now that a spec without the field fuses. Downgrading
leaves the field: ``false`` meant the same before.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("spec", sa.JSON))


def upgrade() -> None:
    connection = op.get_bind()
    for job_id, spec in connection.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        if isinstance(spec, dict) and "fuse_attention" not in spec:
            spec = {**spec, "fuse_attention": False}
            connection.execute(jobs.update().where(jobs.c.id == job_id).values(spec=spec))


def downgrade() -> None:
    pass
