"""Tenants: each tenant has its own pipeline row (its own active parameters and parameter versions), and a job
remembers a hash of the request its idempotency key named (a reused key with another body is a conflict).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("pipelines") as batch:
        batch.add_column(sa.Column("owner", sa.String(64), nullable=False, server_default="anonymous"))
        batch.drop_constraint("uq_pipelines_name", type_="unique")
        batch.create_unique_constraint("uq_pipelines_owner_name", ["owner", "name"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("request_hash", sa.String(64), nullable=True))
    # rows made before tenants belonged to the owner of their jobs; a pipeline shared by several owners stays
    # with "anonymous" (the operator's), and each other owner starts a fresh row from the code's defaults
    op.execute(
        "UPDATE pipelines SET owner = (SELECT MIN(jobs.owner) FROM jobs WHERE jobs.pipeline_id = pipelines.id) "
        "WHERE (SELECT COUNT(DISTINCT jobs.owner) FROM jobs WHERE jobs.pipeline_id = pipelines.id) = 1"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("request_hash")
    with op.batch_alter_table("pipelines") as batch:
        batch.drop_constraint("uq_pipelines_owner_name", type_="unique")
        batch.create_unique_constraint("uq_pipelines_name", ["name"])
        batch.drop_column("owner")
