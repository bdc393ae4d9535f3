"""Node tasks: the dispatch state of each graph node of each item when jobs run on Celery workers (waiting
dependencies, attempts, queue and priority, lease).

Revision ID: 0004
Revises: 0003
Create Date: 2026-02-14
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# spelled out here rather than imported from app.db, so this revision keeps meaning what it meant
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "node_tasks",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("item_id", sa.BigInteger(), nullable=False),
        sa.Column("node_id", sa.String(300), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("claimed_by", sa.String(200), nullable=True),
        sa.Column("deadline", TS, nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["item_id"], ["items.id"], name=op.f("fk_node_tasks_item_id_items"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_node_tasks_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_tasks")),
        sa.UniqueConstraint("item_id", "node_id", name=op.f("uq_node_tasks_item_id_node_id")),
    )
    op.create_index("ix_node_tasks_job_id_status", "node_tasks", ["job_id", "status"])
    op.create_index("ix_node_tasks_status_deadline", "node_tasks", ["status", "deadline"])


def downgrade() -> None:
    op.drop_index("ix_node_tasks_status_deadline", table_name="node_tasks")
    op.drop_index("ix_node_tasks_job_id_status", table_name="node_tasks")
    op.drop_table("node_tasks")
