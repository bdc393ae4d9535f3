"""OpenAI Batch API batches: one row per batch, each run as a job of kind "batch".

Revision ID: 0002
Revises: 0001
Create Date: 2026-02-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# spelled out here rather than imported from app.db, so this revision keeps meaning what it meant
JSONDoc = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("errors", JSONDoc, nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("metadata", JSONDoc, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=True),
        sa.Column("finalizing_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("failed_at", TS, nullable=True),
        sa.Column("expired_at", TS, nullable=True),
        sa.Column("cancelling_at", TS, nullable=True),
        sa.Column("cancelled_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_batches_job_id_jobs"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_owner_id", "batches", ["owner", "id"])


def downgrade() -> None:
    op.drop_index("ix_batches_owner_id", table_name="batches")
    op.drop_table("batches")
